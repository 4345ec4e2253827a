"""What every trainer (SFT, reward model, DPO, RL) does before it loads data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.checkpoint import lock as run_lock
from posttrain.config.core import check, validate_tree
from posttrain.distributed import current, init_from_env
from posttrain.models.factory import load_tokenizer
from posttrain.training.core import set_seed


def prepare_run(
    args: Any,
    model: torch.nn.Module | str | None,
    train_dataset: Any,
    eval_dataset: Any,
    processing_class: Any,
    checks: Callable[[], None] | None = None,
) -> tuple[Any, Any, Any]:
    """Validate `args` (then run the trainer's own `checks`), join torchrun's process group
    (`trainer.strategy`, when launched with WORLD_SIZE > 1), refuse a run directory another
    run holds (`checkpoint.lock`), seed, and resolve the data sources and the tokenizer.

    A string `model` is a local model directory (it becomes `model.path`). Datasets passed
    in win over `data.train_files` / `data.eval_files`. Returns
    (train_source, eval_source or None, tokenizer).
    """
    if isinstance(model, str):
        args.model.path, args.model.init = model, None
    validate_tree(args)
    if checks is not None:
        checks()
    train_source = train_dataset if train_dataset is not None else args.data.train_files
    check(bool(train_source), "data.train_files", "no training data: pass train_dataset or set data.train_files")
    eval_source = eval_dataset if eval_dataset is not None else (args.data.eval_files or None)
    task = getattr(getattr(args, "eval", None), "task", None)
    check(eval_source is not None or task is None, "eval.task", "needs held-out data: set data.eval_files")
    strategy = getattr(args.trainer, "strategy", None)  # sft, rm and dpo have one
    if strategy is not None:
        init_from_env(strategy)  # under torchrun, before any model is built
    if current() is None or current().is_main:  # another run in the folder: refused before loading
        run_lock.check_free(args.trainer.output_dir)
    set_seed(args.trainer.seed)
    tokenizer = processing_class if processing_class is not None else load_tokenizer(args.model)
    return train_source, eval_source, tokenizer
