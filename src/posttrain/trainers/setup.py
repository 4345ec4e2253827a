"""What every trainer (SFT, reward model, DPO, RL) does before it loads data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.config.core import check, validate_tree
from posttrain.data.sources import describe_source
from posttrain.distributed import init_from_env
from posttrain.models.factory import load_tokenizer
from posttrain.rewards.registry import describe_reward
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
    (`trainer.strategy`, when launched with WORLD_SIZE > 1), seed, and resolve the data
    sources and the tokenizer.

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
    set_seed(args.trainer.seed)
    tokenizer = processing_class if processing_class is not None else load_tokenizer(args.model)
    return train_source, eval_source, tokenizer


def python_inputs(train_dataset: Any, eval_dataset: Any, reward_funcs: Any = None, environment_factory: Any = None,
                  tools: Any = None) -> dict[str, Any] | None:
    """What the Python API passed in place of data.train_files, data.eval_files,
    reward.functions, rollout.env and rollout.tools, as config.yaml records it
    (`posttrain.config.inputs`); None when nothing."""
    from posttrain.envs.registry import describe_episodes

    record: dict[str, Any] = describe_episodes(environment_factory, tools)
    if train_dataset is not None:
        record["train_dataset"] = describe_source(train_dataset)
    if eval_dataset is not None:
        record["eval_dataset"] = describe_source(eval_dataset)
    if reward_funcs:
        record["reward_funcs"] = [describe_reward(fn) for fn in reward_funcs]
    return record or None
