"""Sharded model + optimizer state through torch.distributed.checkpoint (DCP).

DCP stores each tensor by its name (the model's parameter names; the optimizer's state keyed
by those names through `get_state_dict`) with the layout it was saved in, and reshards on
load: a checkpoint written by W ranks loads into any number of ranks, one process included
(no process group: DCP then reads and writes alone). Every rank calls both functions.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

SHARDS = "dcp"
"""The folder of a checkpoint that holds the DCP files."""


def save_sharded(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write {"model", "optim"} of this rank into `directory` (collective); {"model"} alone
    when `optimizer` is None (a model that is not trained, e.g. a synced reference)."""
    import torch.distributed.checkpoint as dcp

    with _alone_is_fine():
        dcp.save(_state(model, optimizer), checkpoint_id=str(directory))


def load_sharded(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read what `save_sharded` wrote, resharded to this run's layout, into `model` and
    `optimizer` (None: the model alone) in place (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _state(model, optimizer)
    with _alone_is_fine():
        dcp.load(state, checkpoint_id=str(directory))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


@contextlib.contextmanager
def _alone_is_fine() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
