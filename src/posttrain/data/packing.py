"""Packing tokenized examples into fixed-length rows with best-fit decreasing (BFD).

As TRL's `packing_strategy="bfd"`: examples are taken longest first and each goes into the
open row with the least free space that still fits it, else into a new row. No example is
split across rows (truncate or drop long ones first: `tokenize_dataset(max_length=...)`).

A packed row is `{"input_ids", "labels", "position_ids"}` (lists of equal length, at most
`seq_length`) and has no attention mask:

- `position_ids` restart at 0 at each document. Models read a 0 as a document start and
  attend block-diagonally (causal within a document, nothing across) when `position_ids`
  is given and `attention_mask` is None: `posttrain.models.BuiltinLM` does, and so do
  `transformers` models (`find_packed_sequence_indices`; pass `use_cache=False` so no
  cache disables it).
- `labels` are each document's own labels, aligned with `input_ids` as everywhere (the
  loss shifts by one), except that each document's first label is -100. In a packed row
  that label would be predicted from the previous document's last token; unpacked it is
  never predicted at all (it is at t=0). Masking it makes the packed loss equal the
  unpacked one, token for token.

`pack_collate` makes an `LMBatch` (`posttrain.data.batch`); it pads rows of a batch to a common length with a pseudo-document of pad
tokens (labels -100, positions from 0), which no real token can attend to.

`pack_rows` does the same for the sequences of a padded tensor batch, by index and on its
device: the RL passes' `model.use_remove_padding` (`posttrain.workers.forward`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from posttrain.data.batch import IGNORE_INDEX, LMBatch


def bfd_bins(lengths: Sequence[int], seq_length: int) -> list[list[int]]:
    """Best-fit decreasing: group indices of `lengths` into bins of total ≤ `seq_length`.

    Each bin lists its indices in ascending order; bins are in order of creation. Ties in
    length keep input order, so the result is deterministic.
    """
    too_long = [i for i, n in enumerate(lengths) if n > seq_length or n <= 0]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"{len(too_long)} of {len(lengths)} examples do not fit a packed row of {seq_length} tokens (e.g. "
            f"example {i} has {lengths[i]}); truncate or drop them first, e.g. with "
            f"tokenize_dataset(max_length={seq_length})"
        )
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        k = bisect.bisect_left(free, (lengths[i], -1))  # the tightest bin that fits
        if k == len(free):
            bins.append([i])
            space, b = seq_length, len(bins) - 1
        else:
            space, b = free.pop(k)
            bins[b].append(i)
        if space - lengths[i] > 0:
            bisect.insort(free, (space - lengths[i], b))
    return [sorted(b) for b in bins]


def pack_examples(
    examples: Sequence[Mapping[str, Sequence[int]]], seq_length: int
) -> list[dict[str, list[int]]]:
    """Pack tokenized examples (`input_ids`, `labels`) into rows of at most `seq_length`
    tokens with BFD; see the module doc for the row layout."""
    bins = bfd_bins([len(ex["input_ids"]) for ex in examples], seq_length)
    rows = []
    for members in bins:
        input_ids, labels, position_ids = [], [], []
        for i in members:
            ids = list(examples[i]["input_ids"])
            doc_labels = list(examples[i].get("labels", ids))
            doc_labels[0] = IGNORE_INDEX
            input_ids += ids
            labels += doc_labels
            position_ids += range(len(ids))
        rows.append({"input_ids": input_ids, "labels": labels, "position_ids": position_ids})
    return rows


def packing_efficiency(rows: Sequence[Mapping[str, Sequence[int]]], seq_length: int) -> float:
    """Fraction of the `len(rows) × seq_length` token slots that hold real tokens."""
    if not rows:
        return 0.0
    return sum(len(r["input_ids"]) for r in rows) / (len(rows) * seq_length)


def pack_collate(
    rows: Sequence[Mapping[str, Sequence[int]]],
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
) -> LMBatch:
    """Stack packed rows into an `LMBatch`: `input_ids`, `labels`, `position_ids`, each
    (B, T) int64, and `lengths` (B,), the real tokens of each row.

    Shorter rows are padded on the right with `pad_token_id` (any id: it is never attended
    to by a real token nor trained), labels -100 and positions 0, 1, ... (a separate
    pseudo-document). No `attention_mask`: see the module doc.
    """
    if not rows:
        raise ValueError("pack_collate got no rows")
    T = max(len(r["input_ids"]) for r in rows)
    if pad_to_multiple_of:
        T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    B = len(rows)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((B, T), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(r["labels"], dtype=torch.long)
        position_ids[i, :n] = torch.as_tensor(r["position_ids"], dtype=torch.long)
        position_ids[i, n:] = torch.arange(T - n)
    lengths = torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.long)
    return LMBatch(input_ids=input_ids, labels=labels, lengths=lengths, position_ids=position_ids)



@dataclass
class PackedRows:
    """Variable-length token sequences packed into rows with BFD (`pack_rows`): no padding
    inside a row, only after its last sequence.

    Notation: S sequences, R rows of width W.
    """

    input_ids: torch.Tensor
    """(R, W) long: the sequences back to back; a row's tail holds the pad id."""
    position_ids: torch.Tensor
    """(R, W) long: 0, 1, … within each sequence, and again from 0 over a row's tail (a
    pseudo-document, as `pack_collate`'s), so attention never crosses a sequence."""
    starts: torch.Tensor
    """(S,) long: where each sequence's first token is in the flattened (R·W) rows (0 for an
    empty sequence, which has none)."""
    fill: torch.Tensor
    """(R,) long: tokens of sequences in each row (its tail starts there)."""

    @property
    def real_fraction(self) -> float:
        """Share of the R·W positions that hold a sequence's token (1 − tail padding)."""
        return float(self.fill.sum()) / max(1, self.input_ids.numel())


def pack_slots(lengths: Sequence[int], seq_length: int) -> tuple[list[int], list[int], int]:
    """Where `bfd_bins` puts each sequence in rows of one width: (starts, fill, width).

    lengths: S sequence lengths (0 = left out). width W = the fullest row's fill (≤
    seq_length); starts[s] = the flat index r·W + offset of sequence s's first token in the
    (R·W) rows (0 for an empty one); fill[r] = tokens of sequences in row r (its tail starts
    there). A row's members sit back to back in ascending sequence order.
    """
    kept = [s for s, k in enumerate(lengths) if k > 0]
    if not kept:
        raise ValueError("pack_rows got no token: every sequence is empty")
    bins = [[kept[j] for j in members] for members in bfd_bins([lengths[s] for s in kept], seq_length)]
    fill = [sum(lengths[s] for s in members) for members in bins]
    width = max(fill)
    starts = [0] * len(lengths)
    for r, members in enumerate(bins):
        offset = r * width
        for s in members:
            starts[s], offset = offset, offset + lengths[s]
    return starts, fill, width


def pack_rows(
    ids: torch.Tensor, begin: torch.Tensor, lengths: torch.Tensor, seq_length: int | None = None, pad_id: int = 0
) -> PackedRows:
    """Pack sequence b = ids[b, begin[b] : begin[b] + lengths[b]] of a padded batch into
    rows of at most `seq_length` tokens (default the longest sequence, so no row costs more
    attention than the batch's widest sequence alone) with `bfd_bins` (`pack_slots`).

    ids (B, T) long; begin, lengths (B,) long (a length may be 0: that sequence is left
    out). Everything is built by index, on ids' device: token k of sequence b moves from
    flat index b·T + begin[b] + k to starts[b] + k.
    """
    n = lengths.tolist()
    starts, fill, width = pack_slots(n, seq_length or max(n))
    device = ids.device
    starts_t = torch.tensor(starts, dtype=torch.long, device=device)
    fill_t = torch.tensor(fill, dtype=torch.long, device=device)
    lengths = lengths.to(device)
    seq = torch.repeat_interleave(torch.arange(len(n), device=device), lengths)  # (N,) sequence of each token
    k = torch.arange(len(seq), device=device) - (lengths.cumsum(0) - lengths)[seq]  # (N,) its index within it
    columns = torch.arange(width, device=device)
    position_ids = (columns[None, :] - fill_t[:, None]).clamp(min=0)  # (R, W): the tails' 0, 1, ...
    input_ids = torch.full((len(fill) * width,), pad_id, dtype=ids.dtype, device=device)
    input_ids[starts_t[seq] + k] = ids.reshape(-1)[seq * ids.shape[1] + begin.to(device)[seq] + k]
    position_ids.view(-1)[starts_t[seq] + k] = k
    return PackedRows(input_ids.view(len(fill), width), position_ids, starts_t, fill_t)
