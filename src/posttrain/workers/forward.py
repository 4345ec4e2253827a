"""Teacher-forced forward passes over an RLBatch, shared by the actor, reference and critic.

Notation: B rows, Tp prompt width, Tr response width, V vocab, H hidden size. The input
is `cat(prompt_ids, response_ids)` (B, Tp + Tr); position ids count real tokens only,
so a left-padded prompt starts at position 0, as in the rollout engines. The logits at
column Tp − 1 + t predict response token t, and the state s_t of a critic is the same
column (prompt + response[:t]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from posttrain.models import BuiltinLM
from posttrain.models.loading import device_of  # noqa: F401  (re-exported for the roles)
from posttrain.workers.batch import RLBatch

FORWARD_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "lengths")
"""The RLBatch fields a teacher-forced pass reads (`response_logits`, `per_token_pass`)."""


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask → (B, T) positions of the real tokens (cumsum − 1, 0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def builtin_of(model: nn.Module) -> BuiltinLM | None:
    """The BuiltinLM computing `model` (peft-wrapped or not), or None for other models."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if isinstance(base, BuiltinLM) else None


def response_logits(model: nn.Module, batch: RLBatch) -> torch.Tensor:
    """Logits (B, Tr, V) whose row t scores response token t.

    Only response positions go through the output head (`logits_to_keep` for
    transformers models), never the prompt's. A BuiltinLM reads `cat(prompt, response)`
    without its last column: no logit predicts past the response, and causal attention
    makes the other columns independent of it.
    """
    ids, mask = batch.input_ids, batch.attention_mask
    tp, tr = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    builtin = builtin_of(model)
    if builtin is not None:
        hidden = builtin.hidden_states(ids[:, :-1], mask[:, :-1], position_ids(mask)[:, :-1])[:, tp - 1 :]
        return builtin.lm_head(hidden)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                use_cache=False, logits_to_keep=tr + 1)
    return out.logits[:, -(tr + 1) : -1]


def micro_batches(
    batch: RLBatch,
    rows: int,
    max_tokens: int = 0,
    device: torch.device | str | None = None,
    by_length: bool = False,
) -> list[RLBatch]:
    """Micro-batches of `rows` rows, or of at most `max_tokens` padded tokens when > 0,
    each trimmed of the padding its rows share and moved to `device`. by_length: cut
    them from the rows sorted by length (`RLBatch.by_length`), so they pad less; their
    order is then not the batch's."""
    batch = batch.by_length() if by_length else batch
    parts = batch.chunk_by_tokens(max_tokens) if max_tokens else batch.split(rows)
    return [p.trimmed() if device is None else p.trimmed().to(device) for p in parts]


@torch.no_grad()
def per_token_pass(
    batch: RLBatch,
    fn: Callable[[RLBatch], torch.Tensor | tuple[torch.Tensor, ...]],
    rows: int,
    max_tokens: int = 0,
    device: torch.device | str | None = None,
    collective: Any = None,
) -> tuple[torch.Tensor, ...]:
    """Run `fn(micro_batch) -> (b, tr') tensors` over micro-batches and reassemble (B, Tr)
    tensors, zero on padding, on the CPU. `collective` (a sharded model's workers): every
    worker runs the max over workers of its micro-batch count, repeating its last one and
    dropping the result, since each forward all-gathers with the other workers."""
    width = batch.response_ids.shape[1]
    outs: list[list[torch.Tensor]] = []
    parts = micro_batches(batch, rows, max_tokens, device)
    if collective is not None:
        for _ in range(int(collective.all_max([len(parts)])[0]) - len(parts)):
            fn(parts[-1])
    for part in parts:
        got = fn(part)
        got = got if isinstance(got, tuple) else (got,)
        mask = part.response_mask.bool().to(got[0].device)
        got = [torch.nn.functional.pad(torch.where(mask, g.float(), 0.0).cpu(), (0, width - g.shape[1]))
               for g in got]
        outs.append(got)
    return tuple(torch.cat(col) for col in zip(*outs))
