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


def save_sharded(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write {"model", "optim"} of this rank into `directory` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _alone_is_fine():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))


def load_sharded(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read what `save_sharded` wrote, resharded to this run's layout, into `model` and
    `optimizer` in place (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _alone_is_fine():
        dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


@contextlib.contextmanager
def _alone_is_fine() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
