"""Typed batch containers and the generic row operations they share (veRL's DataProto, typed).

Notation: B rows, T tokens. Every field of a container declares its *kind* in
`field(metadata={"kind": ...})`, and the operations of `BatchOps` (`select`, `concat`,
`split`, `chunk`, `chunk_by_tokens`, `by_length`, `repeat`, `pad_to_multiple`, `to`,
`replace`, `require`) work on any container from those kinds alone:

    "left"      (B, T, ...) tensor, left-padded: padding is added on the left
    "right"     (B, T, ...) tensor, right-padded: padding is added on the right
    "row"       (B, ...) tensor, one value per row
    "list"      list of B Python objects
    "columns"   dict of name -> B values (a list or a (B,) tensor)
    "scalar"    one value for the whole batch (e.g. a total over the optimizer step);
                row operations keep it, `concat` needs it equal in every batch
    "meta"      dict of facts about the whole batch; copied, never indexed

A field may be None (not computed yet); ops keep it None. Wide ("left"/"right") tensors
are padded with the field's `metadata["pad"]`, 0 unless it says otherwise (labels: -100),
so that padding added by `concat` is never trained on. Construction checks that every
filled field has the same B.

The containers of the supervised and preference trainers live here too (`LMBatch`,
`PairBatch`); the RL one, `RLBatch`, is in `posttrain.workers.batch`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

IGNORE_INDEX = -100
"""Label of a position that is not trained (PyTorch's `cross_entropy` default)."""

B = TypeVar("B", bound="BatchOps")

_WIDE = ("left", "right")
_WHOLE = ("scalar", "meta")  # facts about the whole batch, not rows


def _kind(f: dataclasses.Field) -> str:
    kind = f.metadata.get("kind")
    if kind is None:
        raise TypeError(f"batch field {f.name!r} has no metadata kind")
    return kind


def _pad_width(x: torch.Tensor, width: int, side: str, value: float = 0) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    pad = (extra, 0) if side == "left" else (0, extra)
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + pad, value=value)


def _index_values(values: Any, idx: torch.Tensor) -> Any:
    if isinstance(values, torch.Tensor):
        return values[idx.to(values.device)]
    return [values[i] for i in idx.tolist()]


def _cat_values(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return [v for p in parts for v in p]


class BatchOps:
    """Generic row operations for dataclass containers whose fields declare a kind."""

    def __post_init__(self) -> None:
        self._check_rows()

    def _fields(self) -> list[tuple[str, str, Any]]:
        return [(f.name, _kind(f), getattr(self, f.name)) for f in dataclasses.fields(self)]

    def _row_counts(self) -> list[tuple[str, int]]:
        """(name, B) of every filled field that has rows (a column is `name.key`)."""
        counts = []
        for name, kind, value in self._fields():
            if value is None or kind in _WHOLE:
                continue
            if kind == "columns":
                counts += [(f"{name}.{k}", len(v)) for k, v in value.items()]
            else:
                counts.append((name, len(value)))
        return counts

    def _check_rows(self) -> None:
        """Every filled field holds the same number of rows, or a ValueError names two that differ."""
        counts = self._row_counts()
        for name, n in counts[1:]:
            if n != counts[0][1]:
                first, b = counts[0]
                raise ValueError(
                    f"{type(self).__name__}: field {name!r} has {n} rows but {first!r} has {b}"
                )

    def __len__(self) -> int:
        counts = self._row_counts()
        return counts[0][1] if counts else 0

    def require(self, *names: str, role: str, why: str | None = None) -> None:
        """Check that the fields `names` are filled before `role` (e.g. "actor.update") reads
        them: a ValueError names the role and the first missing field. `why` says when the
        field is needed (e.g. "with algorithm.kl.in_loss")."""
        known = {f.name for f in dataclasses.fields(self)}
        for name in names:
            if name not in known:
                raise AttributeError(f"{role}: {type(self).__name__} has no field {name!r}")
            if getattr(self, name) is None:
                when = f" ({why})" if why else ""
                raise ValueError(
                    f"{role} needs {type(self).__name__}.{name}{when}, but it is None: "
                    "fill it before calling this stage"
                )

    def _map(self: B, fn_tensor, fn_list, fn_columns) -> B:
        out = {}
        for name, kind, value in self._fields():
            if value is None:
                out[name] = None
            elif kind == "meta":
                out[name] = copy.copy(value)
            elif kind == "scalar":
                out[name] = value
            elif kind == "list":
                out[name] = fn_list(value)
            elif kind == "columns":
                out[name] = {k: fn_columns(v) for k, v in value.items()}
            else:
                out[name] = fn_tensor(value)
        return type(self)(**out)

    def select(self: B, idx: Sequence[int] | torch.Tensor) -> B:
        """Rows `idx` (indices, or a (B,) bool mask) in that order."""
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool:
            idx = idx.nonzero()[:, 0]
        idx = idx.long().cpu()
        return self._map(
            lambda t: t[idx.to(t.device)],
            lambda v: [v[i] for i in idx.tolist()],
            lambda v: _index_values(v, idx),
        )

    @classmethod
    def concat(cls: type[B], batches: Sequence[B]) -> B:
        """Rows of `batches` one after the other; wide tensors are padded to a common width
        (on their side, with their pad value). A field must be None in all or none; `meta`
        is merged, later batches winning; a `scalar` must be equal in all."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        out = {}
        for f in dataclasses.fields(cls):
            kind, values = _kind(f), [getattr(b, f.name) for b in batches]
            missing = sum(v is None for v in values)
            if missing not in (0, len(values)):
                raise ValueError(f"cannot concat: field {f.name!r} is None in some batches only")
            if missing:
                out[f.name] = None
            elif kind == "meta":
                out[f.name] = {k: v for m in values for k, v in m.items()}
            elif kind == "scalar":
                if any(v != values[0] for v in values):
                    raise ValueError(f"cannot concat: field {f.name!r} differs between batches ({values})")
                out[f.name] = values[0]
            elif kind == "list":
                out[f.name] = [x for v in values for x in v]
            elif kind == "columns":
                keys = list(values[0])
                if any(list(v) != keys for v in values):
                    raise ValueError(f"cannot concat: {f.name} keys differ between batches")
                out[f.name] = {k: _cat_values([v[k] for v in values]) for k in keys}
            elif kind in _WIDE:
                width, pad = max(v.shape[1] for v in values), f.metadata.get("pad", 0)
                out[f.name] = torch.cat([_pad_width(v, width, kind, pad) for v in values])
            else:
                out[f.name] = torch.cat(values)
        return cls(**out)

    def split(self: B, size: int) -> list[B]:
        """Consecutive chunks of `size` rows; the last may be shorter (as `torch.split`)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.select(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def chunk(self: B, n: int) -> list[B]:
        """`n` consecutive chunks of equal size (e.g. one per worker); n must divide len."""
        if n < 1 or len(self) % n:
            raise ValueError(f"cannot chunk {len(self)} rows into {n} equal parts")
        return self.split(len(self) // n)

    def token_counts(self) -> torch.Tensor:
        """(B,) tokens each row puts through a forward pass (for `chunk_by_tokens`).

        Generic default: every row costs the padded width of the widest wide tensor field;
        a container that knows its real lengths overrides this.
        """
        widths = [v.shape[1] for _, kind, v in self._fields() if kind in _WIDE and v is not None]
        return torch.full((len(self),), max(widths, default=1), dtype=torch.long)

    def num_tokens(self) -> int:
        """Σ `token_counts()`: the tokens of all rows (what throughput counts)."""
        return int(self.token_counts().sum())

    def chunk_by_tokens(self: B, max_tokens: int, packed: bool = False) -> list[B]:
        """Consecutive micro-batches of at most `max_tokens` tokens (veRL dynamic batching,
        `use_dynamic_bsz`).

        With c_i = `token_counts()[i]`, a micro-batch of rows i..j costs
        (j − i + 1) · max(c_i..c_j), what a padded forward computes, or Σ c_i..c_j when
        `packed` (padding-free rows: `model.use_remove_padding`). A row costing more than
        `max_tokens` goes alone. Order is kept: `concat` of the result is the batch again.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        bounds, start, widest, total = [], 0, 0, 0
        for i, c in enumerate(self.token_counts().tolist()):
            grown, summed = max(widest, c), total + c
            cost = summed if packed else grown * (i - start + 1)
            if i > start and cost > max_tokens:
                bounds.append((start, i))
                start, grown, summed = i, c, c
            widest, total = grown, summed
        if len(self):
            bounds.append((start, len(self)))
        return [self.select(range(a, b)) for a, b in bounds]

    def by_length(self: B) -> B:
        """The rows in increasing `token_counts()` order (stable), so that consecutive rows
        have similar lengths and a micro-batch cut from them pads little."""
        return self.select(torch.argsort(self.token_counts(), stable=True))

    def repeat(self: B, n: int) -> B:
        """Each row n times in a row: [r0, r0, …, r1, r1, …] (a GRPO group per prompt)."""
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    def pad_to_multiple(self: B, k: int) -> tuple[B, int]:
        """Append copies of the first rows until len is a multiple of k (veRL's
        `pad_dataproto_to_divisor`). Returns (batch, pad); drop the pad rows of a result
        with `select(range(len - pad))`."""
        pad = (-len(self)) % k
        if pad == 0:
            return self, 0
        extra = torch.arange(pad) % len(self)
        return type(self).concat([self, self.select(extra)]), pad

    def to(self: B, device: torch.device | str) -> B:
        """Every tensor moved to `device` (lists, columns' lists, scalars and meta as they are)."""
        return self._map(
            lambda t: t.to(device),
            lambda v: list(v),
            lambda v: v.to(device) if isinstance(v, torch.Tensor) else list(v),
        )

    def replace(self: B, **changes: Any) -> B:
        """A shallow copy with some fields replaced (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)


def _right(pad: int = 0) -> dict[str, Any]:
    return {"kind": "right", "pad": pad}


@dataclass
class LMBatch(BatchOps):
    """Next-token-prediction rows (SFT), from `collate.pad_collate` or `packing.pack_collate`.

    Labels are aligned with the inputs (the loss shifts them: logits at t score labels[t + 1]).
    A padded row holds one example and has an `attention_mask`; a packed row holds several
    documents, has `position_ids` and no mask (the model then attends block-diagonally).
    """

    input_ids: torch.Tensor = field(metadata=_right())
    """(B, T) long: tokens, right-padded (with the pad id from the collators)."""
    labels: torch.Tensor = field(metadata=_right(IGNORE_INDEX))
    """(B, T) long: the token to train on at each position, -100 where nothing is trained
    (padding, masked prompts or turns, the first token of each packed document)."""
    lengths: torch.Tensor = field(metadata={"kind": "row"})
    """(B,) long: real tokens of each row (everything before the right padding)."""
    attention_mask: torch.Tensor | None = field(default=None, metadata=_right())
    """(B, T) long: 1 on real tokens, 0 on padding; None for packed rows."""
    position_ids: torch.Tensor | None = field(default=None, metadata=_right())
    """(B, T) long: packed rows only, restarting at 0 at each document (right padding is a
    pseudo-document no real token attends to)."""

    def token_counts(self) -> torch.Tensor:
        """(B,) real input tokens of each row (padding excluded)."""
        return self.lengths.cpu()


@dataclass
class PairBatch(BatchOps):
    """B preference pairs (reward model, DPO), from `preference.pair_collate`; a row is a pair.

    Each side is prompt + response, right-padded; labels are the response tokens, -100 on
    the prompt and padding, so only the response is scored. The losses run both sides in
    one forward: `input_ids`, `attention_mask`, `labels` are the (2B, T) views, the B chosen
    rows then the B rejected ones.
    """

    chosen_ids: torch.Tensor = field(metadata=_right())
    """(B, Tc) long: prompt + chosen response tokens."""
    chosen_mask: torch.Tensor = field(metadata=_right())
    """(B, Tc) long: 1 on real tokens, 0 on padding."""
    chosen_labels: torch.Tensor = field(metadata=_right(IGNORE_INDEX))
    """(B, Tc) long: chosen response tokens, -100 on the prompt and padding."""
    rejected_ids: torch.Tensor = field(metadata=_right())
    """(B, Tr) long: prompt + rejected response tokens."""
    rejected_mask: torch.Tensor = field(metadata=_right())
    """(B, Tr) long: 1 on real tokens, 0 on padding."""
    rejected_labels: torch.Tensor = field(metadata=_right(IGNORE_INDEX))
    """(B, Tr) long: rejected response tokens, -100 on the prompt and padding."""
    margin: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) float: the data's `margin` column (reward model, Llama 2), when it has one."""
    ref_chosen_logps: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) float: Σ reference log-probs of the chosen response, when DPO precomputed them."""
    ref_rejected_logps: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) float: the same for the rejected response."""
    step_pairs: float | None = field(default=None, metadata={"kind": "scalar"})
    """Pairs in the whole optimizer step this micro-batch belongs to (DPO's RPO term)."""
    step_chosen_tokens: float | None = field(default=None, metadata={"kind": "scalar"})
    """Chosen response tokens in the whole optimizer step (≥ 1; DPO's RPO term)."""

    def _both(self, chosen: torch.Tensor, rejected: torch.Tensor, pad: int = 0) -> torch.Tensor:
        width = max(chosen.shape[1], rejected.shape[1])
        return torch.cat([_pad_width(chosen, width, "right", pad), _pad_width(rejected, width, "right", pad)])

    @property
    def input_ids(self) -> torch.Tensor:
        """(2B, T) long: the chosen rows, then the rejected rows."""
        return self._both(self.chosen_ids, self.rejected_ids)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(2B, T) long, rows as `input_ids`."""
        return self._both(self.chosen_mask, self.rejected_mask)

    @property
    def labels(self) -> torch.Tensor:
        """(2B, T) long, rows as `input_ids`."""
        return self._both(self.chosen_labels, self.rejected_labels, IGNORE_INDEX)

    @property
    def ref_logps(self) -> torch.Tensor | None:
        """(2B,) float reference log-probs, rows as `input_ids`; None when not precomputed."""
        if self.ref_chosen_logps is None:
            return None
        return torch.cat([self.ref_chosen_logps, self.ref_rejected_logps])

    def token_counts(self) -> torch.Tensor:
        """(B,) real tokens of each pair, both sides."""
        return (self.chosen_mask.sum(1) + self.rejected_mask.sum(1)).cpu()
