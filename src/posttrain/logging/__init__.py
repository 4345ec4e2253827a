"""Run logging: metrics sinks (metrics.jsonl, TensorBoard, W&B, MLflow), progress, loggers."""

from __future__ import annotations

import logging

from posttrain.logging.metrics import MetricsLogger
from posttrain.logging.progress import Progress, log_line

__all__ = ["MetricsLogger", "Progress", "get_logger", "log_line"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_configured = False


def get_logger(name: str) -> logging.Logger:
    """A logger under `posttrain`, e.g. `get_logger(__name__)`.

    The first call gives the `posttrain` logger level INFO and, unless the
    application already configured logging (the root logger has a handler), a
    stderr handler with the format `12:03:41 INFO posttrain.trainers.sft: ...`.
    Records still propagate to the root, so an application's handlers see them.
    """
    global _configured
    if not _configured:
        _configured = True
        package = logging.getLogger("posttrain")
        if package.level == logging.NOTSET:
            package.setLevel(logging.INFO)
        if not logging.getLogger().handlers and not package.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
            package.addHandler(handler)
    if name != "posttrain" and not name.startswith("posttrain."):
        name = f"posttrain.{name}"
    return logging.getLogger(name)
