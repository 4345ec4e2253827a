"""Config sections shared by every command: model, data, trainer.

Each field's docstring is its documentation: `posttrain CMD --help` and `docs/config.md`
are generated from it.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from posttrain.config.aliases import aliases, openrlhf, trl, verl
from posttrain.config.core import ConfigError, check

log = logging.getLogger(__name__)

ACCUMULATION = ("set the global batch data.train_batch_size = per_device_train_batch_size × "
                "gradient_accumulation_steps × ranks: the accumulation follows from it and trainer.micro_batch_size")
"""How TRL's gradient_accumulation_steps reads here (sft, rm, dpo)."""


@dataclass
class LoraConfig:
    """Low-rank adapters through `peft`."""

    r: int = field(default=0, metadata=aliases(
        trl("lora_r"), verl("actor_rollout_ref.model.lora_rank"), openrlhf("lora_rank")))
    """LoRA rank; 0 turns LoRA off (full fine-tuning). Python API: TRL's `peft_config=peft.LoraConfig(...)` sets r, alpha, dropout and target_modules."""
    alpha: float = field(default=16.0, metadata=aliases(
        trl("lora_alpha"), verl("actor_rollout_ref.model.lora_alpha"), openrlhf("lora_alpha")))
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = field(default=0.0, metadata=aliases(trl("lora_dropout"), openrlhf("lora_dropout")))
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata=aliases(trl("lora_target_modules"), verl("actor_rollout_ref.model.target_modules"),
                         openrlhf("target_modules")),
    )
    """Names of the linear layers that get adapters (Llama names, the same in Qwen2/Qwen3/Mistral; also `all-linear`)."""
    quantize: Literal["none", "4bit", "8bit"] = field(default="none", metadata=aliases(
        trl("load_in_4bit", {True: "4bit", False: "none"}), trl("load_in_8bit", {True: "8bit", False: "none"}),
        openrlhf("load_in_4bit", {True: "4bit", False: "none"})))
    """Load the frozen base in 4 or 8 bits (QLoRA); needs CUDA and bitsandbytes."""

    def validate(self) -> None:
        check(self.r >= 0, "model.lora.r", f"must be >= 0, got {self.r}")
        check(0.0 <= self.dropout < 1.0, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        check(
            self.quantize == "none" or self.r > 0,
            "model.lora.quantize",
            "quantized training needs LoRA adapters: set model.lora.r > 0",
        )


@dataclass
class ModelConfig:
    """Which model to train: a local Hugging Face checkpoint or a fresh built-in one."""

    path: str | None = field(default=None, metadata=aliases(
        trl("model_name_or_path"), verl("actor_rollout_ref.model.path"), openrlhf("pretrain")))
    """Local directory of a Hugging Face causal LM (config.json + weights). Nothing is downloaded."""
    init: Literal["tiny", "small"] | None = None
    """Start from a freshly initialised built-in model of this size (with the built-in tokenizer)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `model.path` (Python API: the folder a model passed in was loaded from, else `processing_class=` is needed), or the built-in tokenizer with `model.init`."""
    impl: Literal["auto", "builtin", "hf"] = "auto"
    """Model code: `builtin` (our implementation of Llama, Qwen2/Qwen2.5, Qwen3 and Mistral without a sliding window; fast native rollout), `hf` (transformers, any causal LM), or `auto` (builtin for those checkpoints when it implements every feature, else hf; hf under `rollout.engine=hf`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=aliases(
        trl("torch_dtype")))
    """Weight dtype: `auto` is float32 for weights the command trains (the master copy; `trainer.precision` sets the compute dtype), else (a frozen LoRA base, eval, generate) bfloat16 on CUDA when supported, else float32."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda`, or `cuda:N`."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters."""
    gradient_checkpointing: bool = field(default=False, metadata=aliases(
        trl("gradient_checkpointing"), verl("actor_rollout_ref.model.enable_gradient_checkpointing"),
        verl("critic.model.enable_gradient_checkpointing", note="one key for every trained model: the critic too"),
        openrlhf("gradient_checkpointing")))
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (`torch.utils.checkpoint`, non-reentrant), for every model the command trains (RL: the actor and the critic): activation memory falls to about one layer's plus each layer's input, for about one more forward per step. Loss and gradients are the same. Also for a 4/8-bit base (QLoRA), which no longer turns it on by itself."""

    # Setting one of these on the command line clears the other where a YAML file set it
    # (`build_config`): a recipe's model.init gives way to the user's model.path.
    one_of: ClassVar[tuple[str, ...]] = ("path", "init")

    def validate(self) -> None:
        check(
            self.path is None or self.init is None,
            "model.path",
            "set only one of model.path (a local HF model directory) or model.init (tiny|small), not both "
            "in one file or one command line; clear the other with model.init=null (or model.path=null)",
        )
        check_device(self.device, "model.device")
        check(
            self.init is None or self.lora.quantize == "none",
            "model.lora.quantize",
            "quantization applies to a loaded model.path, not to a fresh model.init",
        )


@dataclass
class RLModelConfig(ModelConfig):
    """The policy of an RL command (also the reference's and a default critic's start), and how the RL passes run it."""

    use_remove_padding: bool = field(default=False, metadata=aliases(
        verl("actor_rollout_ref.model.use_remove_padding"),
        verl("critic.model.use_remove_padding", note="one key for every RL model: the critic too")))
    """Padding-free forward passes for the actor's update and log-probs, the reference's log-probs and the critic's values and update: each micro-batch's prompt + response sequences are packed (positions restarting at each sequence, attention never crossing one), so left and right padding is not computed: the built-in model takes all real tokens as one row (as veRL's (1, total_nnz) input) and only its attention regroups them, into rows as wide as the longest sequence (best-fit decreasing); a transformers model takes them packed into such rows. The same log-probs, values, losses and gradients as padded rows. With actor.max_tokens_per_micro_batch, micro-batches are then cut by real tokens. transformers models need position_ids-based packing (transformers' masking_utils; sdpa or eager attention)."""


@dataclass
class DataConfig:
    """Where the examples come from and how they are cut into batches."""

    train_files: list[str] = field(default_factory=list, metadata=aliases(
        trl("train_dataset", same_value=False, note="the trainer's argument: pass the files here"),
        verl("data.train_files"), openrlhf("dataset")))
    """Training data: JSONL, JSON, Parquet or CSV files, or a saved `datasets` folder."""
    eval_files: list[str] = field(default_factory=list, metadata=aliases(
        trl("eval_dataset", same_value=False, note="the trainer's argument: pass the files here"),
        verl("data.val_files"), openrlhf("eval_dataset")))
    """Held-out data for evaluation (same formats)."""
    format: Literal["auto", "text", "prompt_completion", "messages", "preference", "prompt"] = "auto"
    """Dataset format (as TRL); `auto` detects it from the columns."""
    max_length: int = field(default=512, metadata=aliases(trl("max_length"), openrlhf("max_len")))
    """Longest tokenized example, prompt included."""
    truncation: Literal["truncate", "drop"] = "truncate"
    """What to do with a longer example: cut it, or drop it. Either way it is counted and reported."""
    train_batch_size: int = field(default=32, metadata=aliases(
        trl("gradient_accumulation_steps", same_value=False, note=ACCUMULATION),
        openrlhf("train_batch_size")))
    """Examples (prompts, for RL) per optimizer step, across all micro-batches."""
    shuffle: bool = True
    """Shuffle the training examples every epoch (seeded by trainer.seed)."""

    def validate(self) -> None:
        check(self.max_length > 0, "data.max_length", f"must be > 0, got {self.max_length}")
        check(
            self.train_batch_size > 0,
            "data.train_batch_size",
            f"must be > 0, got {self.train_batch_size}",
        )


@dataclass
class TrainerConfig:
    """The optimisation loop: steps, optimizer, schedule, precision, logging, checkpoints."""

    # Setting one of these on the command line clears the other where a YAML file set it
    # (`build_config`): `trainer.num_train_epochs=1` on a recipe with max_steps trains one epoch.
    one_of: ClassVar[tuple[str, ...]] = ("max_steps", "num_train_epochs")

    output_dir: str = field(default="runs/run", metadata=aliases(
        trl("output_dir"), verl("trainer.default_local_dir"), openrlhf("save_path")))
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/ are written here. It
    holds one run: each command defaults to its own (runs/sft, runs/rm, runs/dpo, ...)."""
    max_steps: int | None = field(default=None, metadata=aliases(
        trl("max_steps"), verl("trainer.total_training_steps")))
    """Number of optimizer steps (RL: RL steps). Wins over num_train_epochs when both are set,
    as transformers' max_steps > 0 does. null: num_train_epochs decides, or, when that is null
    too, 100 steps."""
    num_train_epochs: float | None = field(default=None, metadata=aliases(
        trl("num_train_epochs"), verl("trainer.total_epochs")))
    """Passes over the training data (RL: over the prompts), used when max_steps is null:
    max_steps = ceil(num_train_epochs × examples / data.train_batch_size), examples after
    filtering (and packing), set by the trainer once the data is loaded (the log says it,
    config.yaml records it). A fraction trains part of an epoch. Unlike transformers (3 epochs)
    the default is null: 100 steps."""
    max_time_s: float | None = None
    """Wall-clock budget of this process's training loop, in seconds: the run ends at the
    first step that finishes past it (training, evaluation and checkpoints count), then
    evaluates, checkpoints and writes final/ as at max_steps. The lr schedule still spans
    max_steps (or lr_schedule_steps). null = no budget. A resumed run gets the budget afresh."""
    save_on_signal: bool = True
    """On SIGTERM or SIGUSR1 (a preemption: SLURM, Kubernetes, spot instances; SIGUSR1 is
    SLURM's `--signal` warning) the step running finishes, a checkpoint of it is saved and
    sealed (a save under way finishes first), one line names it, and the process exits 143;
    `trainer.resume=auto` continues exactly. torchrun's ranks all stop at one step; on Ray the
    driver stops the workers. false: stop at once, unsaved (one line, exit 143)."""
    learning_rate: float = field(default=1e-4, metadata=aliases(
        trl("learning_rate"), verl("actor_rollout_ref.actor.optim.lr"), verl("optim.lr"),
        openrlhf("actor_learning_rate"), openrlhf("learning_rate")))
    """Peak learning rate (AdamW)."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = field(default="cosine", metadata=aliases(
        trl("lr_scheduler_type", {"cosine": "cosine", "linear": "linear", "constant": "constant",
                                  "constant_with_warmup": "constant", "cosine_with_min_lr": "cosine"}),
        verl("actor_rollout_ref.actor.optim.warmup_style", {"constant": "constant", "cosine": "cosine"}),
        openrlhf("lr_scheduler", {"cosine_with_min_lr": "cosine", "constant": "constant", "linear": "linear"})))
    """Learning-rate shape after warmup."""
    warmup_steps: int = field(default=0, metadata=aliases(
        trl("warmup_steps"), trl("warmup_ratio", same_value=False, note="warmup_steps = warmup_ratio × max_steps"),
        verl("actor_rollout_ref.actor.optim.lr_warmup_steps"),
        verl("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", same_value=False,
             note="warmup_steps = lr_warmup_steps_ratio × max_steps"),
        openrlhf("lr_warmup_ratio", same_value=False, note="warmup_steps = lr_warmup_ratio × max_steps")))
    """Linear warmup from 0 to the peak over this many steps."""
    min_lr_ratio: float = field(default=0.0, metadata=aliases(verl("actor_rollout_ref.actor.optim.min_lr_ratio")))
    """Floor of the cosine/linear decay, as a fraction of the peak."""
    lr_schedule_steps: int | None = None
    """Steps the warmup + decay spans (null: max_steps). Longer than max_steps stops a longer
    schedule part-way, e.g. max_steps=420 with lr_schedule_steps=700 trains the first 420
    steps of a 700-step cosine."""
    weight_decay: float = field(default=0.0, metadata=aliases(
        trl("weight_decay"), verl("actor_rollout_ref.actor.optim.weight_decay"), openrlhf("l2")))
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata=aliases(
        trl("adam_beta1", same_value=False, note="write both as trainer.adam_betas=[beta1,beta2]"),
        trl("adam_beta2", same_value=False, note="write both as trainer.adam_betas=[beta1,beta2]"),
        verl("actor_rollout_ref.actor.optim.betas"), openrlhf("adam_betas")))
    """AdamW (beta1, beta2)."""
    adam_eps: float = field(default=1e-8, metadata=aliases(trl("adam_epsilon")))
    """AdamW epsilon."""
    max_grad_norm: float = field(default=1.0, metadata=aliases(
        trl("max_grad_norm"), verl("actor_rollout_ref.actor.grad_clip"), openrlhf("max_norm")))
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    precision: Literal["auto", "fp32", "bf16"] = field(default="auto", metadata=aliases(
        trl("bf16", {True: "bf16", False: "fp32"}), openrlhf("bf16", {True: "bf16", False: "fp32"})))
    """`bf16` runs forward and backward under bfloat16 autocast (master weights stay fp32); `auto` is bf16 on a CUDA device that supports it, else fp32."""
    seed: int = field(default=0, metadata=aliases(trl("seed"), openrlhf("seed")))
    """Seed for initialisation, shuffling and sampling."""
    resume: str = field(default="auto", metadata=aliases(
        trl("resume_from_checkpoint", {True: "auto", False: "never"}, note="a checkpoint path is trainer.resume=PATH"),
        verl("trainer.resume_mode", {"auto": "auto", "disable": "never"},
             note="resume_mode=resume_path with resume_from_path=P is trainer.resume=P")))
    """`auto` continues from the newest complete checkpoint in output_dir, `never` starts fresh, or a checkpoint path.
    A checkpoint is resumed only by the command that wrote it with the same settings, except
    those listed in `posttrain.checkpoint.RESUME_MAY_CHANGE` (max_steps, cadences, sinks, ...)."""
    overwrite: bool = False
    """Let a fresh start (resume=never, or auto with no checkpoint to continue) replace a run
    already in output_dir: its checkpoints, final/, metrics and logs are removed first.
    Without it such a start is refused, so two runs never mix in one folder."""
    save_steps: int = field(default=0, metadata=aliases(
        trl("save_steps"),
        trl("save_strategy", same_value=False, note="save_strategy=steps with save_steps=N is trainer.save_steps=N; "
            "no is trainer.save_steps=0 (final/ is always written)"),
        verl("trainer.save_freq"), openrlhf("save_steps")))
    """Save a checkpoint every N steps (0: only at the end)."""
    save_total_limit: int = field(default=2, metadata=aliases(trl("save_total_limit"), openrlhf("max_ckpt_num")))
    """Keep at most this many checkpoints, oldest removed first (0: keep all)."""
    eval_steps: int = field(default=0, metadata=aliases(
        trl("eval_steps"),
        trl("eval_strategy", same_value=False, note="eval_strategy=steps with eval_steps=N is trainer.eval_steps=N; "
            "the run always evaluates at its end"),
        verl("trainer.test_freq"), openrlhf("eval_steps")))
    """Evaluate every N steps (0: only at the end)."""
    logging_steps: int = field(default=1, metadata=aliases(trl("logging_steps"), openrlhf("logging_steps")))
    """Write metrics every N steps (RL: also the batch's first training rows to samples.jsonl)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"], metadata=aliases(
        trl("report_to"), verl("trainer.logger", note="console is always on; name tensorboard, wandb or mlflow")))
    """Metric sinks besides metrics.jsonl: any of tensorboard, wandb, mlflow (none: [])."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps whose loss, gradient or update was NaN/inf (each is
    skipped and counted)."""
    progress: bool = True
    """Show a progress bar with ETA on the console."""

    def validate(self) -> None:
        check(self.max_steps is None or self.max_steps > 0, "trainer.max_steps",
              f"must be > 0, or null to train trainer.num_train_epochs epochs (transformers' -1), got {self.max_steps}")
        check(self.num_train_epochs is None or self.num_train_epochs > 0, "trainer.num_train_epochs",
              f"must be > 0 (or null), got {self.num_train_epochs}")
        check(self.max_time_s is None or self.max_time_s > 0, "trainer.max_time_s",
              f"must be > 0 seconds (or null for no budget), got {self.max_time_s}")
        check(self.learning_rate > 0, "trainer.learning_rate", f"must be > 0, got {self.learning_rate}")
        check(self.warmup_steps >= 0, "trainer.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.max_bad_steps >= 1, "trainer.max_bad_steps", f"must be >= 1, got {self.max_bad_steps}")
        check(self.logging_steps >= 1, "trainer.logging_steps", f"must be >= 1, got {self.logging_steps}")
        check(self.save_steps >= 0, "trainer.save_steps", f"must be >= 0 (0: only at the end), got {self.save_steps}")
        check(self.eval_steps >= 0, "trainer.eval_steps", f"must be >= 0 (0: only at the end), got {self.eval_steps}")
        check(self.output_dir.strip() != "", "trainer.output_dir",
              "is empty; name the run's folder, e.g. trainer.output_dir=runs/my_run")
        check(len(self.adam_betas) == 2, "trainer.adam_betas", "needs two values, e.g. [0.9,0.999]")
        check(all(0.0 <= b < 1.0 for b in self.adam_betas), "trainer.adam_betas",
              f"each beta must be in [0, 1), got {self.adam_betas}")
        check(self.adam_eps > 0, "trainer.adam_eps", f"must be > 0, got {self.adam_eps}")
        check(self.weight_decay >= 0, "trainer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.max_grad_norm >= 0, "trainer.max_grad_norm", f"must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        check(0 <= self.seed < 2**32, "trainer.seed", f"must be in [0, 2**32 - 1] (NumPy's range), got {self.seed}")
        check(0.0 <= self.min_lr_ratio <= 1.0, "trainer.min_lr_ratio", "must be in [0, 1]")
        allowed = {"tensorboard", "wandb", "mlflow"}
        unknown = sorted(set(self.report_to) - allowed)
        check(not unknown, "trainer.report_to", f"unknown sink(s) {unknown}; choose from {sorted(allowed)}")
        if self.max_steps is not None:
            self.check_length()

    def check_length(self) -> None:
        """The checks that need the run's length (max_steps known: set, or resolved by `set_length`)."""
        assert self.max_steps is not None
        check(self.lr_schedule_steps is None or self.lr_schedule_steps >= self.max_steps,
              "trainer.lr_schedule_steps", f"must be >= trainer.max_steps={self.max_steps} (or null), "
              f"got {self.lr_schedule_steps}")
        if self.warmup_steps >= self.max_steps:
            log.warning("trainer.warmup_steps=%d >= trainer.max_steps=%d: the run ends before the learning "
                        "rate reaches trainer.learning_rate (warmup is cut short)", self.warmup_steps, self.max_steps)

    def set_length(self, examples: int, batch_size: int) -> int:
        """Fill max_steps once the data is loaded (`examples` rows, `batch_size` per step) and
        return it: max_steps when set (it wins over num_train_epochs, as in transformers), else
        ceil(num_train_epochs × examples / batch_size), else DEFAULT_MAX_STEPS."""
        if self.max_steps is not None:
            if self.num_train_epochs is not None:
                log.info("trainer.max_steps=%d wins over trainer.num_train_epochs=%g (as in transformers); "
                         "set trainer.max_steps=null to train by epochs", self.max_steps, self.num_train_epochs)
            return self.max_steps
        if self.num_train_epochs is None:
            self.max_steps = DEFAULT_MAX_STEPS
        else:
            self.max_steps = steps_for_epochs(self.num_train_epochs, examples, batch_size)
            log.info("trainer.num_train_epochs=%g: %d examples at %d per step = %d steps", self.num_train_epochs,
                     examples, batch_size, self.max_steps)
        self.check_length()
        return self.max_steps


DEFAULT_MAX_STEPS = 100
"""The run's length when neither trainer.max_steps nor trainer.num_train_epochs is set."""


def steps_for_epochs(epochs: float, examples: int, batch_size: int) -> int:
    """Optimizer steps that see `epochs` × `examples` rows at `batch_size` rows per step:
    ceil(epochs · examples / batch_size), at least 1. A step may cross an epoch boundary
    (`trainers.batches.EpochBatches`), so no row of the last epoch is dropped."""
    return max(1, math.ceil(round(epochs * examples / batch_size, 9)))


@dataclass
class OfflineTrainerConfig(TrainerConfig):
    """The optimisation loop of a command that trains on a fixed dataset (sft, rm, dpo): the
    shared options plus the micro-batch size. RL cuts its batches by `actor.*` instead."""

    micro_batch_size: int = field(default=8, metadata=aliases(
        trl("per_device_train_batch_size"), openrlhf("micro_train_batch_size")))
    """Examples per forward/backward pass on one rank; gradients accumulate up to data.train_batch_size."""
    strategy: Literal["none", "ddp", "fsdp2"] = "none"
    """Data parallelism under `torchrun --nproc_per_node N -m posttrain CMD ...`: `ddp` replicates
    the model on every rank; `fsdp2` shards it (`fully_shard` per decoder layer, then the root).
    data.train_batch_size stays the global batch, split across the ranks, and the update equals
    the one-process update. Checkpoints of ddp/fsdp2 are sharded (DCP, resumable at another
    number of ranks, one included) beside a plain HF folder. `none`: one process, no
    torch.distributed."""

    def validate(self) -> None:
        super().validate()
        check(self.micro_batch_size > 0, "trainer.micro_batch_size", "must be > 0")


def check_device(device: str, key: str) -> None:
    """`device` is auto, cpu, cuda or cuda:N, and a CUDA one exists here: a config error
    before anything loads, not torch's traceback from the first tensor moved there."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ConfigError(f"{key}: {device!r} is not a device; expected auto, cpu, cuda or cuda:N")
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: {device} is not available (torch.cuda.is_available() is false on this "
                          f"machine); use {key}=cpu, or auto (CUDA when there is one)")
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    check(index < count, key, f"{device} does not exist: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")


def check_divides(batch: int, batch_key: str, part: int, part_key: str) -> None:
    """`part` must divide `batch` (micro batch into mini batch, mini batch into batch)."""
    if part > batch or batch % part:
        raise ConfigError(f"{part_key}: {part} must divide {batch_key}={batch} "
                          f"(e.g. {part_key}={_largest_divisor(batch, part)})")


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is <= `at_most`, in O(√n) (batch sizes may be huge)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return max(d for d in small + [n // d for d in small] if d <= at_most)


@dataclass
class RefSyncConfig:
    """TR-DPO's reference sync, for every trainer with a reference."""

    ref_sync_steps: int = field(default=0, metadata=aliases(
        trl("ref_model_sync_steps"),
        trl("sync_ref_model", same_value=False, note="sync_ref_model=true with ref_model_sync_steps=N is "
            "algorithm.ref_sync_steps=N (TRL's N is 512); 0 is off")))
    """Every this many steps the reference moves towards the policy: ref ← α·policy + (1 − α)·ref
    (Gorbatovski et al. 2024; TRL's default 512). 0 = off (a frozen reference).
    Refused with LoRA, whose reference is the adapter-disabled base (as TRL refuses it with PEFT)."""
    ref_sync_alpha: float = field(default=0.6, metadata=aliases(trl("ref_model_mixup_alpha")))
    """α of the sync (TRL's default 0.6)."""

    def check_ref_sync(self) -> None:
        check(self.ref_sync_steps >= 0, "algorithm.ref_sync_steps", "must be >= 0 (0 = off)")
        check(0.0 < self.ref_sync_alpha <= 1.0, "algorithm.ref_sync_alpha", "must be in (0, 1]")
