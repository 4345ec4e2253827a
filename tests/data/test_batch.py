"""LMBatch and PairBatch: what the collators fill, real-token counts, pair-wise row ops."""

import pytest
import torch

from posttrain.data.batch import IGNORE_INDEX, LMBatch, PairBatch
from posttrain.data.collate import pad_collate
from posttrain.data.packing import pack_collate, pack_examples
from posttrain.data.preference import pair_collate

P = IGNORE_INDEX


def test_pad_collate_counts_real_tokens_only():
    batch = pad_collate([{"input_ids": [5, 6, 7]}, {"input_ids": [9]}], pad_token_id=0, pad_to_multiple_of=4)
    assert isinstance(batch, LMBatch) and batch.input_ids.shape == (2, 4)
    assert batch.lengths.tolist() == [3, 1]
    assert batch.num_tokens() == 4  # 3 + 1; the 4 padding slots are not counted


def test_pack_collate_counts_the_packed_documents_not_the_padding():
    rows = pack_examples([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6] * 6}], seq_length=6)
    batch = pack_collate(rows, pad_token_id=0)
    assert batch.input_ids.shape == (2, 6) and batch.attention_mask is None
    assert sorted(batch.lengths.tolist()) == [5, 6]
    assert batch.num_tokens() == 11


def test_lm_concat_pads_labels_with_ignore_index():
    a = pad_collate([{"input_ids": [5, 6, 7]}], pad_token_id=0)
    b = pad_collate([{"input_ids": [9]}], pad_token_id=0)
    both = LMBatch.concat([a, b])
    # Padding that concat adds is never trained on: labels -100, mask 0, as pad_collate makes it.
    assert both.labels.tolist() == [[5, 6, 7], [9, P, P]]
    assert both.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert both.num_tokens() == 4


def pairs():
    return [
        {"prompt_ids": [1, 10], "chosen_ids": [11, 2], "rejected_ids": [12, 13, 2], "ref_logps": [-1.0, -2.0]},
        {"prompt_ids": [1], "chosen_ids": [14, 2], "rejected_ids": [15, 2], "ref_logps": [-3.0, -4.0]},
        {"prompt_ids": [1], "chosen_ids": [16], "rejected_ids": [17], "ref_logps": [-5.0, -6.0]},
    ]


def test_a_pair_batch_row_is_a_pair():
    batch = pair_collate(pairs(), pad_token_id=0)
    assert len(batch) == 3 and batch.input_ids.shape == (6, 5)
    assert batch.num_tokens() == (4 + 3 + 2) + (5 + 3 + 2)
    picked = batch.select([2, 0])
    # The chosen rows, then the rejected ones, of pairs 2 and 0: a pair never comes apart.
    assert picked.input_ids.tolist() == [[1, 16, 0, 0, 0], [1, 10, 11, 2, 0], [1, 17, 0, 0, 0], [1, 10, 12, 13, 2]]
    assert picked.ref_logps.tolist() == [-5.0, -1.0, -6.0, -2.0]
    assert picked.margin is None


def test_pair_views_pad_the_narrower_side():
    batch = pair_collate(pairs()[1:], pad_token_id=0)
    narrow = batch.replace(chosen_ids=batch.chosen_ids[:, :2], chosen_mask=batch.chosen_mask[:, :2],
                           chosen_labels=batch.chosen_labels[:, :2])
    assert narrow.input_ids.shape == (4, 3)
    assert narrow.labels[:2].tolist() == [[P, 14, P], [P, 16, P]]


def test_step_totals_survive_row_ops_and_must_agree_to_concat():
    batch = pair_collate(pairs(), pad_token_id=0).replace(step_pairs=3.0, step_chosen_tokens=5.0)
    first, rest = batch.select([0]), batch.select([1, 2])
    assert (first.step_pairs, rest.step_chosen_tokens) == (3.0, 5.0)
    assert PairBatch.concat([first, rest]).step_pairs == 3.0
    with pytest.raises(ValueError, match="step_pairs"):
        PairBatch.concat([first, rest.replace(step_pairs=4.0)])


def test_construction_names_a_field_with_other_rows():
    batch = pad_collate([{"input_ids": [5, 6, 7]}, {"input_ids": [9]}], pad_token_id=0)
    with pytest.raises(ValueError, match=r"LMBatch: field 'lengths' has 3 rows but 'input_ids' has 2"):
        batch.replace(lengths=torch.tensor([3, 1, 1]))
