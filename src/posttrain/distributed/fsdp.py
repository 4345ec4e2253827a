"""FSDP2 inside the RL workers (trainer.strategy=fsdp2 on trainer.backend=ray).

Every model a worker trains or runs (the actor's policy, the reference, the critic) is
sharded over the workers' group: `fully_shard` per decoder layer, then the model (the root:
embeddings, final norm, head; a tied head stays one parameter of the root's group). Of a
peft model the base model is the root (its LoRA weights sit in the layers' groups), so the
entry points the roles call on the base (`hidden_states`, then `lm_head`) run under the
root's hooks; a value model's head is a group of its own (`score` is called after
`hidden_states`). Each worker then holds 1/W of every parameter, gradient and AdamW moment:

    W=4 workers, 2 decoder layers              worker r holds, of each group,
    ┌ root: embed, norm, head ┐ ─┐             rows [r·n/4, (r+1)·n/4) of dim 0 of every
    ├ layer 0                 ┤  ├ 1/4 each   parameter, its gradient and its two AdamW
    └ layer 1                 ┘ ─┘             moments; a forward all-gathers one group at
                                               a time and frees it after (the root's stays
                                               gathered until the backward, FSDP2's default)

On CUDA with trainer.precision bf16 (auto there) the gathered weights compute in bfloat16 and
gradients reduce in float32 (`MixedPrecisionPolicy`); the sharded fp32 weights are AdamW's
master copy. trainer.fsdp.param_offload keeps the shards (and so AdamW's step and state) on
the CPU (`CPUOffloadPolicy`); trainer.fsdp.optimizer_offload keeps AdamW's moments on the CPU
between steps (moved to the device for each step). Both need CUDA (config check).

A collective pass (log-probs, values) must run as many forwards on every worker, or the
all-gathers go out of step: `equal_passes` pads a worker's micro-batches to the max count.
Weight reads gather one parameter at a time (`stream_full`, `full_copy`), so no process holds
more than one full parameter beyond what it keeps.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from posttrain.models.loading import is_sharded  # noqa: F401  (re-exported: the roles read it from models)

FORWARD_METHODS = ("hidden_states", "scores", "values")
"""Entry points besides `forward` that run a model's layers (registered with FSDP2)."""


def shard_root(model: nn.Module) -> nn.Module:
    """The module `fully_shard` takes as root: a peft model's base model, else `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shard_model(model: nn.Module, mp_policy: Any = None, offload_policy: Any = None) -> nn.Module:
    """`fully_shard` per decoder layer, a value head (`score`), then the root (module doc), in
    place; `model` is returned. Extra entry points (`FORWARD_METHODS`) are registered."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from posttrain.distributed.wrap import decoder_layers

    kw: dict[str, Any] = {}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    root = shard_root(model)
    for layer in decoder_layers(root):
        fully_shard(layer, **kw)
    if isinstance(getattr(root, "score", None), nn.Linear):
        fully_shard(root.score, **kw)
    fully_shard(root, **kw)
    for method in FORWARD_METHODS:
        if callable(getattr(root, method, None)):
            register_fsdp_forward_method(root, method)
    return model


def policies(precision: str, device: torch.device, param_offload: bool) -> tuple[Any, Any]:
    """(MixedPrecisionPolicy or None, CPUOffloadPolicy or None) for `shard_model`: bf16
    compute with fp32 reduction when `precision` resolves to bf16 on `device` (CUDA)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from posttrain.training.core import resolve_precision

    mp = None
    if device.type == "cuda" and resolve_precision(precision, device) == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return mp, (CPUOffloadPolicy() if param_offload else None)


def reshard(model: nn.Module) -> None:
    """Free every gathered group of a sharded `model` (the root stays gathered after a forward
    that no backward follows: a no-grad pass)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensors(model: nn.Module, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each parameter (and buffer) of `model`, one at a time: a shard's
    `DTensor.full_tensor()` (an all-gather: every worker iterates in step), else the tensor.
    Tied parameters come once (`named_parameters`)."""
    reshard(model)
    for name, t in [*model.named_parameters(), *(model.named_buffers() if buffers else ())]:
        yield name, gathered(t).detach()


def gathered(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor's `full_tensor()`, its local shard first moved to the mesh's device
    when it is offloaded to the CPU (trainer.fsdp.param_offload: NCCL gathers CUDA tensors)."""
    if not hasattr(t, "full_tensor"):
        return t
    local, mesh = t.to_local(), t.device_mesh
    if local.device.type != mesh.device_type:
        from torch.distributed.tensor import DTensor

        t = DTensor.from_local(local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()


@torch.no_grad()
def stream_full(sharded: nn.Module, target: nn.Module) -> None:
    """Copy a sharded model's weights into `target`, a plain module of the same structure (a
    colocated engine's own copy), parameter by parameter: the extra memory is one full
    parameter. Collective. Buffers (rotary tables) are not trained: the engine keeps its own."""
    dest = dict(target.named_parameters())
    for name, full in full_tensors(sharded, buffers=False):
        dest[name].copy_(full)


def skeleton(model: nn.Module, device: str = "meta") -> nn.Module:
    """A copy of `model`'s structure whose parameters are empty on `device` (meta: no memory),
    tied ones still tied; buffers are copied (small: rotary tables). Taken before sharding,
    for `full_copy`."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                            for p in model.parameters()}
    return copy.deepcopy(model, memo)


@torch.no_grad()
def full_copy(sharded: nn.Module, template: nn.Module, keep: bool) -> nn.Module | None:
    """A plain CPU module with `sharded`'s full weights, built on `template` (`skeleton`)
    parameter by parameter; every worker gathers (collective), the one with `keep` (rank 0)
    returns it, the others None and hold one parameter at a time. Buffers are the template's
    (not trained)."""
    out = skeleton(template, "cpu") if keep else None
    dest = dict(out.named_parameters()) if out is not None else {}
    for name, full in full_tensors(sharded, buffers=False):
        if out is not None:
            dest[name].copy_(full.to(dest[name].dtype))
    return out


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Keep AdamW's state on the CPU between steps (trainer.fsdp.optimizer_offload): each step
    moves it to its parameters' device first and back to the CPU after (step hooks)."""

    def move(to_params: bool) -> None:
        for p, state in optimizer.state.items():
            device = p.device if to_params else torch.device("cpu")
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":
                    state[k] = v.to(device, non_blocking=True)

    optimizer.register_step_pre_hook(lambda *_: move(True))
    optimizer.register_step_post_hook(lambda *_: move(False))


def local_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Bytes this process holds of `tensors`: a DTensor's local shard, else the tensor."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def training_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This worker's bytes of parameters, gradients and optimizer state (after a step, before
    `zero_grad` drops the gradients: pass `grads` counted then), from the tensors' local sizes."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": local_bytes(params), "grads": local_bytes(grads), "optimizer": local_bytes(state)}
