"""Masked reductions against numbers worked out by hand."""

import math

import pytest
import torch

from posttrain.algos import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # valid values: 1, 2 | 4


def test_masked_sum_and_mean_by_hand():
    # sum = 1 + 2 + 4 = 7 over 3 valid values → mean 7/3
    assert masked_sum(X, MASK).item() == 7.0
    assert masked_mean(X, MASK).item() == pytest.approx(7 / 3)
    # per row: sums (3, 4), means (1.5, 4)
    torch.testing.assert_close(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 4.0]).double())
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 4.0]).double())


def test_bool_float_and_int_masks_agree():
    for mask in (MASK.bool(), MASK.float(), MASK):
        assert masked_mean(X, mask).item() == pytest.approx(7 / 3)


def test_garbage_under_padding_never_leaks():
    garbage = X.clone()
    garbage[MASK == 0] = torch.tensor([math.inf, math.nan, -math.inf], dtype=torch.float64)
    assert masked_sum(garbage, MASK).item() == 7.0
    assert masked_var(garbage, MASK).item() == pytest.approx(7 / 3)
    assert torch.isfinite(masked_whiten(garbage, MASK)).all()


def test_empty_selection_gives_zero_not_nan():
    empty = torch.zeros_like(MASK)
    assert masked_mean(X, empty).item() == 0.0
    torch.testing.assert_close(masked_mean(X, empty, dim=-1), torch.zeros(2).double())
    assert masked_var(X, empty).item() == 0.0


def test_masked_var_by_hand():
    # valid 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3
    assert masked_var(X, MASK).item() == pytest.approx((14 / 3) / 2)  # Bessel: / (n - 1)
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx((14 / 3) / 3)
    single = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert masked_var(X, single).item() == 0.0


def test_masked_whiten_by_hand():
    out = masked_whiten(X, MASK, eps=0.0)
    std = math.sqrt(7 / 3)
    expected = torch.tensor(
        [[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]]
    ).double()
    torch.testing.assert_close(out, expected)
    kept = masked_whiten(X, MASK, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept, torch.where(MASK.bool(), expected + 7 / 3, 0.0))


def test_masked_whiten_matches_torch_on_the_valid_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=gen) > 0.3
    valid = x[mask]
    expected = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    torch.testing.assert_close(masked_whiten(x, mask)[mask], expected)
