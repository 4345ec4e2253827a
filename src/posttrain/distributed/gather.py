"""Full weights from sharded ones, one parameter at a time: what worker 0 writes an HF folder from.

Under FSDP2 (`trainer.strategy=fsdp2`) a worker's parameters are `DTensor`s, each holding its
shard; `DTensor.full_tensor()` all-gathers one of them (a collective: every worker of the
group calls it, in the same order). `full_module` gathers the parameters and buffers one by
one, moving each to the CPU before the next is gathered, so the extra peak on the worker's
device is one parameter (at most a decoder layer's largest matrix), and builds a CPU module of
plain tensors that every save path writes as it writes an unsharded model. An unsharded model
is returned as it is: no copy, and the same files as before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return None
    return DTensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: `t.full_tensor()` for a DTensor (collective), else `t` itself."""
    dtensor = _dtensor_type()
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t


def is_sharded(model: torch.nn.Module) -> bool:
    """Any parameter or buffer of `model` is a DTensor (FSDP2)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in (*model.parameters(), *model.buffers()))


def full_module(model: torch.nn.Module) -> torch.nn.Module:
    """`model` itself when nothing in it is sharded; else a CPU copy of it whose parameters and
    buffers are the full tensors, gathered one at a time (`full_tensor`, then to the CPU) and
    given to `deepcopy` through its memo (tied parameters stay tied: one entry per tensor).
    Every worker of the group must call it (the gathers are collectives)."""
    if not is_sharded(model):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(full_tensor(p.detach()).to("cpu", copy=True), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = full_tensor(b.detach()).to("cpu", copy=True)
    return copy.deepcopy(model, memo)
