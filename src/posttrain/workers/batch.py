"""Typed batch containers that travel between the RL roles (veRL's DataProto, but typed).

Notation: B rows (one response each; B = prompts × n after `repeat(n)`), Tp prompt width,
Tr response width. A row is `[pad … pad, prompt | response, pad … pad]`: prompts are
left-padded and responses right-padded, so `cat(prompt_ids, response_ids)` is a causal
LM input whose response starts at column Tp for every row.

Every field of a container declares its *kind* in `field(metadata={"kind": ...})`, and the
generic operations below (`select`, `concat`, `split`, `chunk`, `chunk_by_tokens`,
`repeat`, `pad_to_multiple`, `to`, `replace`) work on any container from those kinds alone:

    "prompt"    (B, Tp) tensor, left-padded: padding is added on the left
    "response"  (B, Tr) tensor, right-padded: padding is added on the right
    "row"       (B,) tensor, one value per row
    "list"      list of B Python objects
    "columns"   dict of name -> B values (a list or a (B,) tensor)
    "meta"      dict of facts about the whole batch; copied, never indexed

A field may be None (not computed yet); ops keep it None. What padding holds is never
read by a role or an algorithm (masks decide), so ops pad with 0.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from posttrain.data.prompts import collate_prompts

B = TypeVar("B", bound="BatchOps")

_WIDE = ("prompt", "response")


def _kind(f: dataclasses.Field) -> str:
    kind = f.metadata.get("kind")
    if kind is None:
        raise TypeError(f"batch field {f.name!r} has no metadata kind")
    return kind


def _pad_width(x: torch.Tensor, width: int, side: str) -> torch.Tensor:
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    pad = (extra, 0) if side == "prompt" else (0, extra)
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + pad, value=0)


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

    def _fields(self) -> list[tuple[str, str, Any]]:
        return [(f.name, _kind(f), getattr(self, f.name)) for f in dataclasses.fields(self)]

    def __len__(self) -> int:
        for _, kind, value in self._fields():
            if value is None or kind == "meta":
                continue
            if kind == "columns":
                if value:
                    return len(next(iter(value.values())))
                continue
            return len(value)
        return 0

    def _map(self: B, fn_tensor, fn_list, fn_columns) -> B:
        out = {}
        for name, kind, value in self._fields():
            if value is None:
                out[name] = None
            elif kind == "meta":
                out[name] = copy.copy(value)
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
        (prompts on the left, responses on the right). A field must be None in all or none;
        `meta` is merged, later batches winning."""
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
            elif kind == "list":
                out[f.name] = [x for v in values for x in v]
            elif kind == "columns":
                keys = list(values[0])
                if any(list(v) != keys for v in values):
                    raise ValueError(f"cannot concat: {f.name} keys differ between batches")
                out[f.name] = {k: _cat_values([v[k] for v in values]) for k in keys}
            elif kind in _WIDE:
                width = max(v.shape[1] for v in values)
                out[f.name] = torch.cat([_pad_width(v, width, kind) for v in values])
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

        Generic default: every row costs the padded width of the widest 2-D tensor field;
        a container that knows its real lengths (RLBatch) overrides this.
        """
        widths = [v.shape[1] for _, kind, v in self._fields()
                  if isinstance(v, torch.Tensor) and kind not in ("meta", "list", "columns") and v.dim() >= 2]
        return torch.full((len(self),), max(widths, default=1), dtype=torch.long)

    def chunk_by_tokens(self: B, max_tokens: int) -> list[B]:
        """Consecutive micro-batches of at most `max_tokens` padded tokens (veRL dynamic
        batching, `use_dynamic_bsz`).

        With c_i = `token_counts()[i]`, a micro-batch of rows i..j costs
        (j − i + 1) · max(c_i..c_j), what a padded forward computes. A row costing more than
        `max_tokens` goes alone. Order is kept: `concat` of the result is the batch again.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        bounds, start, widest = [], 0, 0
        for i, c in enumerate(self.token_counts().tolist()):
            grown = max(widest, c)
            if i > start and grown * (i - start + 1) > max_tokens:
                bounds.append((start, i))
                start, grown = i, c
            widest = grown
        if len(self):
            bounds.append((start, len(self)))
        return [self.select(range(a, b)) for a, b in bounds]

    def by_length(self: B) -> B:
        """The rows in increasing `token_counts()` order (stable), so that consecutive rows
        have similar lengths and a micro-batch cut from them pads little: the update's
        micro-batches combine exactly in any order (`algos.aggregation_weight`)."""
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
        """Every tensor moved to `device` (lists, columns' lists and meta as they are)."""
        return self._map(
            lambda t: t.to(device),
            lambda v: list(v),
            lambda v: v.to(device) if isinstance(v, torch.Tensor) else list(v),
        )

    def replace(self: B, **changes: Any) -> B:
        """A shallow copy with some fields replaced (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)


@dataclass
class RLBatch(BatchOps):
    """One RL step's data as it moves driver → roles → driver (fields fill in stage by stage).

    Rows of a group (the n responses to one prompt) are contiguous: rows [kn, (k+1)n)
    answer prompt k. Log-probs are of the temperature-scaled policy, log softmax(z/T)[y].
    """

    prompt_ids: torch.Tensor | None = field(default=None, metadata={"kind": "prompt"})
    """(B, Tp) long: prompt tokens, left-padded (BOS / chat template included)."""
    prompt_mask: torch.Tensor | None = field(default=None, metadata={"kind": "prompt"})
    """(B, Tp) long: 1 on prompt tokens, 0 on left padding."""
    response_ids: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) long: generated tokens, right-padded; a stop token (EOS) is kept as the last one."""
    response_mask: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) long: 1 on tokens that are trained on, 0 on padding (and on rows that
    `algorithm.mask_truncated_completions` removes from the loss)."""
    rollout_logp: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) float: log-probs the rollout engine reported while sampling."""
    old_logp: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) float: log-probs of the behaviour policy π_old (the ratio's denominator)."""
    ref_logp: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) float: log-probs under the frozen reference π_ref (only when KL is used)."""
    values: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) float: critic values V(s_t), s_t = prompt + response[:t] (PPO only)."""
    token_rewards: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) float: per-token reward r_t: the sequence score on the last valid token,
    minus β·KL_t when the KL penalty is in the reward."""
    advantages: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) float: advantage of every token (sequence-level estimators broadcast theirs)."""
    returns: torch.Tensor | None = field(default=None, metadata={"kind": "response"})
    """(B, Tr) float: value targets (GAE) for the critic."""
    scores: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) float: the sequence reward (weighted reward functions and/or reward model,
    plus overlong and missing-EOS shaping)."""
    uid: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) long: id of the prompt a row answers, unique within a run (rows of a group share it)."""
    truncated: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) bool: generation hit max_new_tokens without a stop token."""
    lengths: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) long: generated tokens per row (before any loss masking)."""
    prompts: list[Any] | None = field(default=None, metadata={"kind": "list"})
    """B prompts as the dataset gave them (a string or a list of chat messages)."""
    completions: list[Any] | None = field(default=None, metadata={"kind": "list"})
    """B decoded responses (a string; a one-message list for chat prompts, as TRL)."""
    columns: dict[str, Any] | None = field(default=None, metadata={"kind": "columns"})
    """Dataset columns besides the prompt (answer, tests, task, …): name -> B values."""
    rewards: dict[str, torch.Tensor] | None = field(default=None, metadata={"kind": "columns"})
    """Per-sample reward terms, name -> (B,) float: each reward function's raw value (NaN
    where it gave None), `total` (their weighted sum, before shaping), `correct` (0/1)."""
    meta: dict[str, Any] = field(default_factory=dict, metadata={"kind": "meta"})
    """Facts about the whole batch (e.g. {"n": 8})."""

    @classmethod
    def from_prompts(cls, examples: Sequence[dict], pad_id: int) -> RLBatch:
        """A batch holding only prompts, from `data.prompts.load_prompts` examples."""
        return cls(**collate_prompts(examples, pad_id))

    # -------------------------------------------------------------- derived views

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, Tp + Tr) long: prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def generated_mask(self) -> torch.Tensor:
        """(B, Tr) long: 1 on every generated token, from `lengths` (unlike `response_mask`,
        not cleared for rows taken out of the loss)."""
        width = self.response_ids.shape[1]
        lengths = self.lengths.to(self.response_ids.device)
        return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, Tp + Tr) long: 1 on prompt and generated tokens (what the model sees does not
        depend on which rows the loss uses)."""
        return torch.cat([self.prompt_mask, self.generated_mask.to(self.prompt_mask.dtype)], dim=1)

    def trimmed(self) -> RLBatch:
        """The same rows without all-padding columns (left of the prompts, right of the
        responses), so a forward pass does no work for padding the whole batch shares."""
        prompt_start = int((self.prompt_mask.sum(0) > 0).nonzero()[0, 0]) if len(self) else 0
        width = int(self.lengths.max()) if len(self) else 0
        out = {}
        for name, kind, value in self._fields():
            if value is not None and kind == "prompt":
                value = value[:, prompt_start:]
            elif value is not None and kind == "response":
                value = value[:, :width]
            out[name] = value
        return RLBatch(**out)

    def token_counts(self) -> torch.Tensor:
        """(B,) prompt plus generated tokens of each row."""
        return self.prompt_mask.sum(1).cpu() + self.lengths.cpu()

    def num_tokens(self) -> int:
        """Prompt plus generated tokens of all rows (what throughput counts)."""
        return int(self.token_counts().sum())
