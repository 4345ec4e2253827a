"""DAPO helpers: overlong punishment (eq. 13) and the dynamic-sampling filter."""

import pytest
import torch

from posttrain.algos import filter_groups, grpo_advantages, overlong_penalty


def test_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 4: no penalty up to 16, linear to −α at 20, −α beyond
    #   L = 10 → 0 ; 16 → 0 ; 17 → (16 − 17)/4 = −0.25 ; 19 → −0.75 ; 20 → −1 ; 25 → −1
    lengths = torch.tensor([10, 16, 17, 19, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, penalty=0.5), expected * 0.5)


def test_overlong_penalty_rejects_empty_buffer():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([3]), 10, 0)


def test_filter_groups_keeps_groups_with_different_scores():
    # groups: (1, 1, 1, 0) mixed, (1, 1, 1, 1) all correct, (0, 0, 0, 0) all wrong
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    keep = filter_groups(scores, 4)
    torch.testing.assert_close(keep, torch.tensor([True, False, False]))
    per_response = keep.repeat_interleave(4)
    assert per_response.shape == (12,) and per_response[:4].all() and not per_response[4:].any()
    # exactly the groups whose GRPO advantages are not all zero
    nonzero = grpo_advantages(scores, 4).view(3, 4).ne(0).any(-1)
    torch.testing.assert_close(keep, nonzero)
