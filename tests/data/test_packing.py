"""BFD packing: bin choice, row layout, efficiency, and packed loss == unpacked loss."""

import random

import pytest
import torch

from posttrain.data.collate import IGNORE_INDEX, causal_lm_loss_sum, pad_collate, tokenize_dataset
from posttrain.data.packing import (
    bfd_bins,
    pack_collate,
    pack_examples,
    pack_rows,
    pack_slots,
    packing_efficiency,
)
from posttrain.data.tokenizer import build_tokenizer


def test_bfd_by_hand():
    # seq 8, lengths 5 4 3 3 2 1, longest first:
    # 5 -> new bin0 (3 free); 4 -> new bin1 (4 free); 3 (#2) -> bin0, the tightest fit (0 free);
    # 3 (#3) -> bin1 (1 free); 2 -> new bin2 (6 free); 1 -> bin1, tighter than bin2 (0 free).
    assert bfd_bins([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]


def test_bfd_rejects_examples_that_do_not_fit():
    with pytest.raises(
        ValueError,
        match=r"example 1 has 9\); truncate or drop them first, e.g. with tokenize_dataset\(max_length=8\)",
    ):
        bfd_bins([3, 9], 8)


def test_packed_row_layout():
    examples = [
        {"input_ids": [1, 10, 11], "labels": [-100, -100, 11]},
        {"input_ids": [1, 20, 21, 22], "labels": [1, 20, 21, 22]},
        {"input_ids": [1, 30], "labels": [1, 30]},
    ]
    rows = pack_examples(examples, seq_length=7)
    # BFD: 4 tokens -> row0; 3 -> row0 (full at 7); 2 -> row1. Documents keep input order.
    assert rows[0] == {
        "input_ids": [1, 10, 11, 1, 20, 21, 22],
        "labels": [-100, -100, 11, -100, 20, 21, 22],  # each document's first label masked
        "position_ids": [0, 1, 2, 0, 1, 2, 3],
    }
    assert rows[1]["position_ids"] == [0, 1]
    batch = pack_collate(rows, pad_token_id=0)
    assert batch.attention_mask is None and batch.position_ids is not None  # no attention_mask
    assert batch.input_ids[1].tolist() == [1, 30, 0, 0, 0, 0, 0]
    assert batch.labels[1].tolist() == [-100, 30] + [IGNORE_INDEX] * 5
    assert batch.position_ids[1].tolist() == [0, 1, 0, 1, 2, 3, 4]  # padding is its own document


def test_every_example_lands_in_exactly_one_row_whole():
    rng = random.Random(0)
    examples = [{"input_ids": [i] * rng.randint(1, 40), "labels": [i] * 1} for i in range(300)]
    for ex in examples:
        ex["labels"] = list(ex["input_ids"])
    rows = pack_examples(examples, seq_length=64)
    assert all(len(r["input_ids"]) <= 64 for r in rows)
    seen = sorted(
        tuple(r["input_ids"][s:e]) for r in rows for s, e in _doc_spans(r["position_ids"])
    )
    assert seen == sorted(tuple(ex["input_ids"]) for ex in examples)


def _doc_spans(position_ids):
    starts = [i for i, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
    return list(zip(starts, starts[1:]))


def test_bfd_efficiency_on_many_short_examples():
    rng = random.Random(1)
    lengths = [rng.randint(8, 200) for _ in range(2000)]
    rows = pack_examples([{"input_ids": [0] * n} for n in lengths], seq_length=1024)
    efficiency = packing_efficiency(rows, 1024)
    print(f"BFD packing efficiency: {efficiency:.4f} over {len(rows)} rows")
    assert efficiency >= 0.9


def test_packed_loss_equals_unpacked_loss():
    from posttrain.models import BuiltinLM

    tok = build_tokenizer()
    rng = random.Random(2)
    words = ["the", "cat", "sat", "on", "a", "mat", "2+2", "=", "4", "yes", "no"]
    rows = [
        {
            "prompt": " ".join(rng.choices(words, k=rng.randint(1, 5))),
            "completion": " ".join(rng.choices(words, k=rng.randint(1, 6))),
        }
        for _ in range(12)
    ]
    examples, _ = tokenize_dataset(rows, tok, max_length=48)
    torch.manual_seed(0)
    model = BuiltinLM.from_preset("tiny", vocab_size=len(tok)).eval()
    with torch.no_grad():
        batch = pad_collate(examples, tok.pad_token_id)
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
        sum_unpacked, n_unpacked = causal_lm_loss_sum(logits, batch.labels)

        packed = pack_collate(pack_examples(examples, seq_length=64), pad_token_id=tok.pad_token_id)
        assert packed.input_ids.shape[0] < len(examples)  # several documents share rows
        logits = model(packed.input_ids, position_ids=packed.position_ids)
        sum_packed, n_packed = causal_lm_loss_sum(logits, packed.labels)
    assert n_packed.item() == n_unpacked.item()
    assert (sum_packed / n_packed).item() == pytest.approx(
        (sum_unpacked / n_unpacked).item(), abs=1e-5
    )
    # Without block-diagonal attention the documents would see each other: the check has teeth.
    with torch.no_grad():
        leaky = model(packed.input_ids, attention_mask=torch.ones_like(packed.input_ids))
        sum_leaky, _ = causal_lm_loss_sum(leaky, packed.labels)
    assert abs((sum_leaky - sum_packed).item()) > 1e-3


def test_pack_rows_by_hand():
    # Three padded rows; their sequences are ids[b, begin : begin + length]: [11 12 13],
    # [21 22], [31 32 33 34 35], and an empty one. Width = the longest (5); BFD longest first:
    # 5 -> row0 (full); 3 -> row1 (2 free); 2 -> row1 (full).
    ids = torch.tensor([[0, 11, 12, 13, 0], [21, 22, 0, 0, 0], [31, 32, 33, 34, 35], [0, 0, 0, 0, 0]])
    packed = pack_rows(ids, torch.tensor([1, 0, 0, 2]), torch.tensor([3, 2, 5, 0]), pad_id=9)
    assert packed.input_ids.tolist() == [[31, 32, 33, 34, 35], [11, 12, 13, 21, 22]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packed.starts.tolist() == [5, 8, 0, 0] and packed.fill.tolist() == [5, 5]
    assert pack_slots([3, 2, 5, 0], 5) == ([5, 8, 0, 0], [5, 5], 5)  # (starts, fill, width)
    assert pack_slots([3, 2, 5, 0], 7) == ([7, 0, 2, 0], [7, 3], 7)
    # A wider budget packs more (a row's members in input order); a row's tail is a
    # pseudo-document of pad ids from position 0.
    wide = pack_rows(ids, torch.tensor([1, 0, 0, 2]), torch.tensor([3, 2, 5, 0]), seq_length=7, pad_id=9)
    assert wide.input_ids.tolist() == [[21, 22, 31, 32, 33, 34, 35], [11, 12, 13, 9, 9, 9, 9]]
    assert wide.position_ids.tolist() == [[0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3]]
    assert wide.starts.tolist() == [7, 0, 2, 0] and wide.real_fraction == 10 / 14
