"""What every trainer (SFT, reward model, DPO, RL) does before it loads data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.checkpoint import lock as run_lock
from posttrain.config.core import ConfigError, check, validate_tree
from posttrain.config.sections import TrainerConfig
from posttrain.data.sources import describe_source
from posttrain.distributed import current, init_from_env
from posttrain.distributed.env import refuse_launch_of_several
from posttrain.models.factory import load_tokenizer
from posttrain.models.llama_checkpoint import read_config_json
from posttrain.models.lora import is_peft, lora_from_peft
from posttrain.rewards.registry import describe_reward
from posttrain.training.core import set_seed

RL_SCALE_OUT = ("launch it once, without torchrun; RL runs data-parallel on Ray workers: "
                "trainer.backend=ray trainer.n_workers_per_node=N (docs/distributed.md)")


def prepare_run(
    args: Any,
    model: torch.nn.Module | str | None,
    train_dataset: Any,
    eval_dataset: Any,
    processing_class: Any,
    checks: Callable[[], None] | None = None,
    peft_config: Any = None,
    classifier: bool = False,
) -> tuple[Any, Any, Any]:
    """Validate `args` (then run the trainer's own `checks`), join torchrun's process group
    (`trainer.strategy`, when launched with WORLD_SIZE > 1; a config without one, RL's, is
    refused there), refuse a run directory another run holds (`checkpoint.lock`), seed, and
    resolve the data sources and the tokenizer.

    A string `model` is a local model directory (it becomes `model.path`). A `peft_config`
    (TRL's: a `peft.LoraConfig`) becomes `model.lora` (`lora_from_peft`; `classifier`: the
    trainer trains a reward model). Datasets passed in win over `data.train_files` /
    `data.eval_files`. The tokenizer is `processing_class`, else `load_tokenizer`'s for the
    module passed in or the model configured. Returns (train_source, eval_source or None,
    tokenizer).
    """
    if isinstance(model, str):
        args.model.path, args.model.init = model, None
    if peft_config is not None:
        check(args.model.lora.r == 0, "model.lora.r",
              f"is {args.model.lora.r} and peft_config is given too; set one of them")
        model_type = model_type_of(model if isinstance(model, torch.nn.Module) else None, args.model.path)
        args.model.lora = lora_from_peft(peft_config, args.model.lora, model_type, classifier)
    validate_tree(args)
    if checks is not None:
        checks()
    train_source = train_dataset if train_dataset is not None else args.data.train_files
    check(bool(train_source), "data.train_files", "no training data: pass train_dataset or set data.train_files")
    eval_source = eval_dataset if eval_dataset is not None else (args.data.eval_files or None)
    task = getattr(getattr(args, "eval", None), "task", None)
    check(eval_source is not None or task is None, "eval.task", "needs held-out data: set data.eval_files")
    if hasattr(args, "rollout"):  # RL: its data parallelism is Ray's (trainer.strategy shards inside its workers)
        refuse_launch_of_several(getattr(args, "command", "rl"), RL_SCALE_OUT)
    else:  # sft, rm and dpo: torchrun's process group, before any model is built
        init_from_env(args.trainer.strategy)
    if current() is None or current().is_main:  # another run in the folder: refused before loading
        run_lock.check_free(args.trainer.output_dir)
    set_seed(args.trainer.seed)
    if processing_class is not None:
        return train_source, eval_source, processing_class
    module = model if isinstance(model, torch.nn.Module) else None
    return train_source, eval_source, load_tokenizer(args.model, module)


def model_type_of(model: torch.nn.Module | None, path: str | None) -> str:
    """config.json's `model_type` of the module passed in, else of `path`; the built-in
    model's is "llama"."""
    if model is not None:
        base = model.get_base_model() if is_peft(model) else model
        return getattr(base.config, "model_type", None) or "llama"
    if path is not None:
        try:
            return read_config_json(path).get("model_type") or "llama"
        except FileNotFoundError as err:
            raise ConfigError(f"model.path: {err}") from None
    return "llama"


MAX_PASSES_PER_STEP = 16
"""The most passes over the training data one step may make. A step may cross epoch boundaries
(a batch of 32 on 8 rows sees each row 4 times), but a batch this far beyond the data is a
typo or a mix-up of units, and would be gathered and allocated whole (1e9 rows: tens of GB)."""


def set_train_length(args: Any, examples: int) -> int:
    """Fill trainer.max_steps from trainer.num_train_epochs (or the default length) once the
    trainer knows its `examples` (prompts for RL), at data.train_batch_size per step
    (`TrainerConfig.set_length`), and run the checks that need it, before any model is built:
    a batch more than `MAX_PASSES_PER_STEP` passes over the data is refused. Returns max_steps."""
    trainer: TrainerConfig = args.trainer
    batch = args.data.train_batch_size
    check(batch <= MAX_PASSES_PER_STEP * examples, "data.train_batch_size",
          f"{batch} is far beyond the data: {examples} training examples, so one step would pass over them "
          f"{batch / max(examples, 1):,.0f} times (more than {MAX_PASSES_PER_STEP}); set data.train_batch_size "
          f"<= {examples}, or add data")
    steps = trainer.set_length(examples, batch)
    if hasattr(args, "check_length"):
        args.check_length()
    return steps


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
