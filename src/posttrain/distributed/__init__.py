"""Data parallelism on torch.distributed: the process group from torchrun's environment
(`env`), DDP / FSDP2 wrapping (`wrap`), the collectives a training step needs (`collectives`),
each rank's slice of a global batch (`data`) and sharded checkpoints (`checkpoint`).

Nothing here runs unless `trainer.strategy` is ddp or fsdp2 and `WORLD_SIZE` > 1: the
default single process never imports torch.distributed's process-group machinery.
"""

from posttrain.distributed.checkpoint import SHARDS, load_sharded, save_sharded
from posttrain.distributed.collectives import Collective
from posttrain.distributed.data import rank_slice
from posttrain.distributed.env import DistContext, current, init_from_env, shutdown
from posttrain.distributed.wrap import Wrapped, wrap

__all__ = [
    "SHARDS",
    "Collective",
    "DistContext",
    "Wrapped",
    "current",
    "init_from_env",
    "load_sharded",
    "rank_slice",
    "save_sharded",
    "shutdown",
    "wrap",
]
