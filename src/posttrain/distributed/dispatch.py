"""How a batch is cut across data-parallel workers and put back together (veRL's dispatch
modes, on any `BatchOps` container).

Notation: B rows, W workers, c_i the token count of row i (`token_counts()`).

- ONE_TO_ALL: the same arguments to every worker (setup, state, weight sync).
- RANK_ZERO: worker 0 alone (generation in rollout.seed_mode=batch, which must draw the
  local backend's samples from one random stream).
- DP_SPLIT (`split_contiguous` → run → concatenate): the batch is cut into W contiguous
  slices of ⌊B/W⌋ or ⌈B/W⌉ rows, each worker told the index of its slice's first row, and
  the results (any number of rows per input row) are concatenated in slice order. For
  generation, whose cost is unknown before it runs (so rows are balanced by count, not by
  tokens) and whose rows must keep their index in the batch (rollout.seed_mode=row draws by
  it). A worker left without rows (B < W) runs nothing.
- DP_COMPUTE (`shard_rows` → run → `gather_rows`): the batch is padded to a multiple of W
  with copies of its first rows, cut into W parts of B' / W rows whose token totals are about
  equal (`balanced_partition`, veRL's `_balance_batch`), each worker computes its part, and
  the results are put back in the batch's row order with the padding dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.batch import BatchOps


def balanced_partition(costs: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Row indices → k parts of about equal total cost (greedy longest-first, the idea of
    veRL's `_balance_batch`, which uses Karmarkar–Karp): rows in decreasing cost go to the
    part with the least cost so far (ties: fewer rows, then lower index), among the parts
    that have room for ⌈B/k⌉ rows when `equal_size`. With B ≥ k every part gets a row.
    Each part lists its rows in increasing order.

    costs [5, 1, 1, 1, 4, 2], k 2 → [[0, 1, 2], [3, 4, 5]] (totals 7 and 7).
    """
    if k < 1:
        raise ValueError(f"cannot partition into {k} parts")
    cap = -(-len(costs) // k) if equal_size else len(costs)
    parts: list[list[int]] = [[] for _ in range(k)]
    totals = [0.0] * k
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min((j for j in range(k) if len(parts[j]) < cap), key=lambda j: (totals[j], len(parts[j]), j))
        parts[j].append(i)
        totals[j] += costs[i]
    return [sorted(p) for p in parts]


@dataclass
class Sharded:
    """A batch cut into one part per worker, and how to put results back."""

    parts: list[Any]
    """W containers; part r goes to worker r."""
    order: torch.Tensor
    """(B',) long: the padded batch's row index of each row of cat(parts)."""
    rows: int
    """B: rows of the batch before padding (padded rows have indices ≥ B)."""


def shard_rows(batch: BatchOps, world_size: int, pad: bool = True) -> Sharded:
    """DP_COMPUTE's split. pad: to a multiple of W first (copies of the first rows, dropped by
    `gather_rows`), so every part has B'/W rows; otherwise the parts' sizes may differ by
    more than one row (an update, whose padding would have to weigh nothing)."""
    padded, _ = batch.pad_to_multiple(world_size) if pad else (batch, 0)
    idx = balanced_partition(padded.token_counts().tolist(), world_size, equal_size=pad)
    order = torch.tensor([i for p in idx for i in p], dtype=torch.long)
    return Sharded([padded.select(p) for p in idx], order, len(batch))


def gather_rows(outputs: Sequence[Any], sharded: Sharded) -> Any:
    """DP_COMPUTE's gather: per-worker results (containers, or tensors with one row per
    input row) → one result in the batch's row order, padding dropped. Wide tensors of
    different widths are right-padded with 0 (what padding holds is never read)."""
    if isinstance(outputs[0], BatchOps):
        joined = type(outputs[0]).concat(list(outputs))
    else:
        joined = _cat_rows(list(outputs))
    inverse = torch.empty_like(sharded.order)
    inverse[sharded.order] = torch.arange(len(sharded.order))
    keep = inverse[: sharded.rows]
    return joined.select(keep) if isinstance(joined, BatchOps) else joined[keep]


def split_contiguous(batch: BatchOps, world_size: int) -> list[tuple[Any, int]]:
    """DP_SPLIT's split: W (part, first) pairs, part r holding rows [first_r, first_{r+1}) of
    `batch` (the first B mod W parts one row more), None where B < W leaves a part empty
    (its `first` is then B). Concatenating the parts in order gives the batch.

    B 5, W 2 → (rows 0-2, 0), (rows 3-4, 3); B 1, W 2 → (row 0, 0), (None, 1).
    """
    if world_size < 1:
        raise ValueError(f"cannot split into {world_size} parts")
    size, extra = divmod(len(batch), world_size)
    out, first = [], 0
    for r in range(world_size):
        rows = size + (r < extra)
        out.append((batch.select(range(first, first + rows)) if rows else None, first))
        first += rows
    return out


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() >= 2:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in tensors]
    return torch.cat(tensors)
