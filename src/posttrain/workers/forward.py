"""Teacher-forced forward passes over an RLBatch, shared by the actor, reference and critic.

Notation: B rows, Tp prompt width, Tr response width, V vocab, H hidden size. The input
is `cat(prompt_ids, response_ids)` (B, Tp + Tr); position ids count real tokens only,
so a left-padded prompt starts at position 0, as in the rollout engines. The logits at
column Tp − 1 + t predict response token t, and the state s_t of a critic is the same
column (prompt + response[:t]).

Two layouts of the same computation (`model.use_remove_padding`, veRL's name):
- padded: the (B, Tp + Tr − 1) rows as they are (the last column predicts nothing);
- packed: each row's real tokens, prompt + response[:L − 1] (L = its trajectory length),
  positions restarting at every sequence and attention kept inside it, so left and right
  padding is not computed. The built-in model takes them as one row of N real tokens (as
  veRL's (1, total_nnz) input): its attention regroups the sequences itself
  (`models.document_rows`), so only attention sees the regrouped rows' tails. A
  transformers model takes them packed into rows as wide as the longest sequence
  (`data.packing.pack_rows`; with SDPA a single row would cost N² attention), and computes
  those rows' tails too. The states s_0 … s_{L−1} are gathered back into (B, Tr, …)
  tensors, zero at padding (`ResponseLayout`). Log-probs, values and losses equal the
  padded ones.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.config import ConfigError
from posttrain.data.packing import PackedRows, pack_rows
from posttrain.models import BuiltinLM
from posttrain.models.loading import device_of  # noqa: F401  (re-exported for the roles)
from posttrain.workers.batch import RLBatch

FORWARD_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "lengths")
"""The RLBatch fields a teacher-forced pass reads (`response_logits`, `per_token_pass`)."""

HiddenFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]
"""`hidden(input_ids (R, W), attention_mask (R, W) or None, position_ids (R, W)) -> (R, W, H)`:
a backbone's final hidden states (`BuiltinLM.hidden_states`, `ScalarHeadModel.hidden_states`)."""


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask → (B, T) positions of the real tokens (cumsum − 1, 0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def builtin_of(model: nn.Module) -> BuiltinLM | None:
    """The BuiltinLM computing `model` (peft-wrapped or not), or None for other models."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if isinstance(base, BuiltinLM) else None


@dataclass
class ResponseLayout:
    """Where the response states of a micro-batch sit in its packed rows.

    Notation: b rows of the micro-batch, N = Σ L_i response states, R × W packed rows.
    """

    rows: PackedRows
    """The packed input: prompt + response[:L − 1] of every row."""
    source: torch.Tensor
    """(N,) long: flat index into the (R·W) packed positions of state s_t of row i, for every
    (i, t < L_i) in row-major order."""
    target: torch.Tensor
    """(N,) long: flat index i·Tr + t of the same state in the (b, Tr) response layout."""
    shape: tuple[int, int]
    """(b, Tr)."""

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """(R, W, *) outputs of the packed rows → (N, *) at the response states."""
        return packed.flatten(0, 1)[self.source]

    def scatter(self, states: torch.Tensor) -> torch.Tensor:
        """(N, *) → (b, Tr, *), zero at padding (differentiable)."""
        out = states.new_zeros((self.shape[0] * self.shape[1], *states.shape[1:]))
        return out.index_copy(0, self.target, states).view(*self.shape, *states.shape[1:])


def pack_responses(batch: RLBatch, one_row: bool = False) -> ResponseLayout:
    """The packed layout of `batch` (see the module docstring): all real tokens in one row
    (`one_row`: the built-in model), else rows as wide as the longest sequence. Row i's
    real tokens are the contiguous columns [Tp − n_i, Tp + L_i) of `input_ids` (n_i prompt
    tokens, left-padded; L_i = `trajectory_lengths`); the last is fed to nothing, since no
    state reads it."""
    tp, tr = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    n_prompt = batch.prompt_mask.sum(1)
    trajectory = batch.trajectory_lengths.to(n_prompt.device)
    if bool((n_prompt == 0).any()):
        raise ValueError("model.use_remove_padding: a row has no prompt token, so no logit predicts its "
                         "first response token")
    columns = torch.arange(tp + tr, device=n_prompt.device)
    contiguous = (columns >= tp - n_prompt[:, None]) & (columns < tp + trajectory[:, None])
    if not torch.equal(contiguous.long(), batch.attention_mask.long()):
        raise ValueError("model.use_remove_padding: the batch's prompts are not left-padded (or its responses "
                         "not right-padded); pack them with model.use_remove_padding=false")
    lengths = torch.where(trajectory > 0, n_prompt + trajectory - 1, 0)
    rows = pack_rows(batch.input_ids, tp - n_prompt, lengths, int(lengths.sum()) if one_row else None)
    seq = torch.repeat_interleave(torch.arange(len(batch), device=trajectory.device), trajectory)  # (N,)
    t = torch.arange(len(seq), device=seq.device) - (trajectory.cumsum(0) - trajectory)[seq]  # (N,)
    source = rows.starts.to(seq.device)[seq] + n_prompt[seq] - 1 + t
    return ResponseLayout(rows, source, seq * tr + t, (len(batch), tr))


def response_states(
    hidden: HiddenFn, batch: RLBatch, heads: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    remove_padding: bool = False,
    one_row: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`heads` applied to the hidden states of s_0 … s_{Tr−1} only: each output (b, Tr, *).

    heads: (…, H) → a tuple of (…, *) tensors (an LM head, a value head, or both). Padded:
    `hidden` reads cat(prompt, response) without its last column; packed: the packed rows
    (`pack_responses(batch, one_row)`; one_row for a built-in backbone), and the heads see
    the N real states only (zero at padding in the result).
    """
    if remove_padding:
        layout = pack_responses(batch, one_row)
        states = layout.gather(hidden(layout.rows.input_ids, None, layout.rows.position_ids))  # (N, H)
        return tuple(layout.scatter(out) for out in heads(states))
    ids, mask = batch.input_ids, batch.attention_mask
    tp = batch.prompt_ids.shape[1]
    return heads(hidden(ids[:, :-1], mask[:, :-1], position_ids(mask)[:, :-1])[:, tp - 1 :])


def response_logits(model: nn.Module, batch: RLBatch, remove_padding: bool = False) -> torch.Tensor:
    """Logits (B, Tr, V) whose row t scores response token t (zero at padding when packed).

    Only response positions go through the output head, never the prompt's: a BuiltinLM's
    `lm_head` is applied to the response states (`response_states`); a transformers model
    computes `logits_to_keep` columns (padded: the last Tr + 1; packed: every column that
    holds some response state, since its forward keeps columns, not positions).
    """
    builtin = builtin_of(model)
    if builtin is not None:
        (logits,) = response_states(builtin.hidden_states, batch, lambda h: (builtin.lm_head(h),), remove_padding,
                                    one_row=True)
        return logits
    if remove_padding:
        return packed_hf_logits(model, pack_responses(batch))
    ids, mask = batch.input_ids, batch.attention_mask
    tr = batch.response_ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                use_cache=False, logits_to_keep=tr + 1)
    return out.logits[:, -(tr + 1) : -1]


def packed_hf_logits(model: nn.Module, layout: ResponseLayout) -> torch.Tensor:
    """A transformers causal LM over packed rows → (b, Tr, V). transformers reads packed
    sequences from position_ids restarting at 0 when attention_mask is None and there is no
    cache (`masking_utils.find_packed_sequence_indices`), as `check_packing_support` checks."""
    check_packing_support(model)
    rows = layout.rows
    width = rows.input_ids.shape[1]
    r, c = layout.source // width, layout.source % width
    keep = torch.unique(c)  # sorted columns with a response state in some row
    out = model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False,
                logits_to_keep=keep if len(keep) < width else 0)
    logits = out.logits  # (R, K, V), K = len(keep) or W
    index = r * logits.shape[1] + (torch.searchsorted(keep, c) if len(keep) < width else c)
    return layout.scatter(logits.flatten(0, 1)[index])


def check_packing_support(model: nn.Module) -> None:
    """Refuse a transformers model that cannot run packed rows: its forward must take
    `position_ids` and its modeling file build masks with `masking_utils` (which detects
    packed sequences for the sdpa, eager and flex kernels; flash-attention reads the
    positions itself)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, getattr(base, "base_model_prefix", ""), base)
    module = sys.modules.get(type(inner).__module__)
    takes_positions = "position_ids" in inspect.signature(base.forward).parameters
    if takes_positions and hasattr(module, "create_causal_mask"):
        return
    raise ConfigError(f"model.use_remove_padding: {type(base).__name__} cannot run packed sequences (its forward "
                      "must take position_ids and build its mask with transformers' masking_utils); set "
                      "model.use_remove_padding=false")


def micro_batches(
    batch: RLBatch,
    rows: int,
    max_tokens: int = 0,
    device: torch.device | str | None = None,
    by_length: bool = False,
    packed: bool = False,
) -> list[RLBatch]:
    """Micro-batches of `rows` rows, or of at most `max_tokens` tokens when > 0 (padded
    tokens, or real ones when `packed`: `model.use_remove_padding`), each trimmed of the
    padding its rows share and moved to `device`. by_length: cut them from the rows sorted
    by length (`RLBatch.by_length`), so they pad less; their order is then not the batch's."""
    batch = batch.by_length() if by_length else batch
    parts = batch.chunk_by_tokens(max_tokens, packed) if max_tokens else batch.split(rows)
    return [p.trimmed() if device is None else p.trimmed().to(device) for p in parts]


@torch.no_grad()
def per_token_pass(
    batch: RLBatch,
    fn: Callable[[RLBatch], torch.Tensor | tuple[torch.Tensor, ...]],
    rows: int,
    max_tokens: int = 0,
    device: torch.device | str | None = None,
    packed: bool = False,
    collective: Any = None,
) -> tuple[torch.Tensor, ...]:
    """Run `fn(micro_batch) -> (b, tr') tensors` over micro-batches and reassemble (B, Tr)
    tensors, zero on padding, on the CPU, in float32 (float64 from a float64 model).
    `collective` (a sharded model's workers): every worker runs the max over workers of its
    micro-batch count, repeating its last one and dropping the result, since each forward
    all-gathers with the other workers."""
    width = batch.response_ids.shape[1]
    outs: list[list[torch.Tensor]] = []
    parts = micro_batches(batch, rows, max_tokens, device, packed=packed)
    if collective is not None:
        for _ in range(int(collective.all_max([len(parts)])[0]) - len(parts)):
            fn(parts[-1])
    for part in parts:
        got = fn(part)
        got = got if isinstance(got, tuple) else (got,)
        mask = part.response_mask.bool().to(got[0].device)
        got = [torch.nn.functional.pad(torch.where(mask, g.to(torch.promote_types(g.dtype, torch.float32)), 0.0).cpu(),
                                       (0, width - g.shape[1]))
               for g in got]
        outs.append(got)
    return tuple(torch.cat(col) for col in zip(*outs))
