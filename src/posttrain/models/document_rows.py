"""Attention over packed documents, computed per document group rather than per input row.

Packed input (`position_ids` restarting at 0 at each document, no attention mask: the
layout of `data.packing` and of `model.use_remove_padding`, where the RL passes feed all
real tokens of a micro-batch as one row) attends causally inside each document and never
across. One block-diagonal mask over an input row of T tokens costs T² per row, nearly
all of it masked out. Instead the documents of all rows are regrouped with best-fit
decreasing into attention rows as wide as the longest document (`pack_slots`: R × W);
q, k and v are scattered into them, attention runs per attention row (causal inside each
document; a row's tail is a pseudo-document of zeros that only sees itself), and the
outputs are gathered back. The norms, projections and MLP run on the input tokens as given,
so a padding-free input computes no padding there: only the attention rows' tails are extra.

Notation: B input rows of T tokens, N = B·T, n heads, D head size, R attention rows of width W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data.packing import pack_slots


@dataclass
class DocumentRows:
    """Where each input token sits in the attention rows (see the module docstring)."""

    index: torch.Tensor
    """(N,) long: the slot r·W + w of input token b·T + t in the flattened (R·W) rows."""
    rows: int
    """R."""
    width: int
    """W, the longest document."""
    mask: torch.Tensor
    """(R, 1, W, W) bool, True = may attend: causal and inside one document."""

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n, T, D) → (R, n, W, D), zero in the rows' tails."""
        b, n, t, d = x.shape
        flat = x.transpose(1, 2).reshape(b * t, n, d)
        rows = flat.new_zeros(self.rows * self.width, n, d).index_copy(0, self.index, flat)
        return rows.view(self.rows, self.width, n, d).transpose(1, 2)

    def merge(self, y: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """(R, n, W, D) → (B, n, T, D): the inverse of `split` at the input tokens."""
        n, d = y.shape[1], y.shape[3]
        flat = y.transpose(1, 2).reshape(self.rows * self.width, n, d)[self.index]  # (N, n, D)
        return flat.view(b, t, n, d).transpose(1, 2)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions → (N,) bool over the flattened tokens: True where a document
    starts (every row's first token, and wherever the position does not continue the
    previous one by +1: transformers' `find_packed_sequence_indices` rule)."""
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return start.reshape(-1)


def document_rows(position_ids: torch.Tensor) -> DocumentRows:
    """The attention rows of packed input with these (B, T) `position_ids`."""
    starts = document_starts(position_ids).nonzero().squeeze(1)  # (S,) first token of each document
    n = position_ids.numel()
    lengths = torch.diff(starts, append=starts.new_tensor([n]))  # (S,)
    slots, fill, width = pack_slots(lengths.tolist(), int(lengths.max()))
    device = position_ids.device
    doc = torch.repeat_interleave(torch.arange(len(starts), device=device), lengths)  # (N,) document of each token
    k = torch.arange(n, device=device) - starts[doc]  # (N,) index within its document
    index = torch.tensor(slots, dtype=torch.long, device=device)[doc] + k
    rows = len(fill)
    # Document id per slot: -1 in a row's tail (its own pseudo-document, so each tail query
    # sees at least itself and attention gives no NaN anywhere, forward or backward).
    owner = torch.full((rows * width,), -1, dtype=torch.long, device=device).index_copy(0, index, doc)
    owner = owner.view(rows, width)
    column = torch.arange(width, device=device)
    causal = column[None, :] <= column[:, None]  # (W, W): key ≤ query
    mask = (owner[:, :, None] == owner[:, None, :]) & causal
    return DocumentRows(index, rows, width, mask[:, None])
