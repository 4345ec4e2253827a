"""The process group of a `torchrun` launch, read from its environment.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process;
`init_from_env` joins the group they describe (gloo on a CPU, NCCL on CUDA, as veRL and
accelerate do) once per process. With WORLD_SIZE unset or 1 it does nothing and returns
None: a single process pays for nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from posttrain.config import ConfigError

STRATEGIES = ("none", "ddp", "fsdp2")


@dataclass(frozen=True)
class DistContext:
    """This process's place in the group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    """Where this rank computes: cuda:LOCAL_RANK under NCCL, else cpu."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_CONTEXT: DistContext | None = None


def world_size_from_env() -> int:
    """WORLD_SIZE, 1 when unset."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def refuse_launch_of_several(command: str, fix: str) -> None:
    """Refuse a `command` that runs in one process when it is one of WORLD_SIZE > 1 torchrun
    processes: each would run on its own and they would write over one another's run folder
    (one "resuming" the other's checkpoint, one deleting the other's save). Raised in every
    process, before any file is written; `fix` says how to run it instead."""
    world = world_size_from_env()
    if world > 1:
        raise ConfigError(f"posttrain {command} runs in one process, but this is rank "
                          f"{os.environ.get('RANK', '?')} of WORLD_SIZE={world} (torchrun): each would run on "
                          f"its own and write over the others' files; {fix}")


def init_from_env(strategy: str, timeout_s: float = 1800.0) -> DistContext | None:
    """Join torchrun's process group for `trainer.strategy`; None for a single process.

    Refuses a launch of several processes with `strategy=none` (each would train alone and
    they would overwrite one another's run directory). Idempotent: a second call returns the
    group already joined.
    """
    global _CONTEXT
    if strategy not in STRATEGIES:
        raise ConfigError(f"trainer.strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
    world = world_size_from_env()
    if world <= 1:
        return None
    if strategy == "none":
        raise ConfigError(f"trainer.strategy: this process is one of WORLD_SIZE={world} (torchrun); "
                          "set trainer.strategy=ddp or trainer.strategy=fsdp2")
    if _CONTEXT is not None:
        return _CONTEXT
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
    _CONTEXT = DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)
    return _CONTEXT


def current() -> DistContext | None:
    """The group `init_from_env` joined in this process, or None."""
    return _CONTEXT


def is_main_process() -> bool:
    """Rank 0 of the group joined, or a single process: the one that prints."""
    return _CONTEXT is None or _CONTEXT.is_main


def shutdown() -> None:
    """Leave the group (a no-op when none was joined)."""
    global _CONTEXT
    if _CONTEXT is None:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTEXT = None
