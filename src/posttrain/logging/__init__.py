"""Run logging: metrics sinks (metrics.jsonl, TensorBoard, W&B, MLflow), progress, loggers."""

from __future__ import annotations

import logging
import os

from posttrain.logging.metrics import MetricsLogger
from posttrain.logging.progress import Progress, log_line

__all__ = ["MetricsLogger", "Progress", "default_level", "get_logger", "log_line"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_configured = False


def get_logger(name: str) -> logging.Logger:
    """A logger under `posttrain`, e.g. `get_logger(__name__)`.

    The first call gives the `posttrain` logger level INFO and, unless the
    application already configured logging (the root logger has a handler), a
    stderr handler with the format `12:03:41 INFO posttrain.trainers.sft: ...`.
    Records still propagate to the root, so an application's handlers see them.
    In a data-parallel rank other than 0 (torchrun's RANK) the level is ERROR
    instead (`default_level`): rank 0 speaks for all, the others only report errors.
    """
    global _configured
    if not _configured:
        _configured = True
        package = logging.getLogger("posttrain")
        if package.level == logging.NOTSET:
            package.setLevel(default_level())
        if not logging.getLogger().handlers and not package.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
            package.addHandler(handler)
    if name != "posttrain" and not name.startswith("posttrain."):
        name = f"posttrain.{name}"
    return logging.getLogger(name)


def default_level(environ=os.environ) -> int:
    """INFO, or ERROR in a torchrun process whose RANK is not 0 (every rank would print
    the same lines; progress bars are rank 0's alone too, `trainers.loop`)."""
    rank = environ.get("RANK", "0").strip() or "0"
    return logging.INFO if rank == "0" else logging.ERROR
