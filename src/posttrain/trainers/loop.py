"""The one outer loop every trainer drives: SFT, reward model, DPO and RL.

    start → for each step: task.step → guard → metrics → ref sync? → eval? → log
          → checkpoint? → … → last eval → final/

(start: resume check → run directory → config.yaml → restore.)

A trainer brings a `Task`: its step function and its state (what a checkpoint holds, how
it is restored, what `final/` holds). Everything else is here, once, so every command
follows the same rules:
- one run at a time: the run directory is locked for the run's life (`checkpoint.lock`), so
  a second run in the same folder is refused at once, naming the holder's pid;
- the start: `trainer.resume` picks the checkpoint; it must be one of this run (the same
  command and fingerprint, `checkpoint.check_resume`), checked before any weights load; a
  new run never shares its folder with another (`checkpoint.claim_run_dir`,
  `trainer.overwrite`); config.yaml is written once these checks pass; then the task
  restores everything in the checkpoint, and every checkpoint it saves records the run;
- preemption (`trainers/preempt.py`): SIGTERM or SIGUSR1 ends the step running, saves a
  sealed checkpoint of it and raises `Preempted` (the CLI: one line, exit 143), all ranks at
  the same step; `trainer.save_on_signal=false` raises at once;
- the wall-clock budget (`trainer.max_time_s`) and `trainer.max_steps` (filled from
  `trainer.num_train_epochs` by the trainer once its data is loaded); `epoch` (passes over
  the data, fractional) in every command's metrics;
- the user's callbacks (`trainers/callbacks.py`, transformers' TrainerCallback events and
  TrainerControl flags: a callback may stop the run, or ask for an eval, a checkpoint or a
  metrics line at a step);
- the eval cadence (`trainer.eval_steps`, and always once at the end), samples.jsonl (the
  eval samples; an RL task's training samples at every logged step, `rl_samples`);
- metric sinks and the progress bar; `nonfinite_steps` in every command's metrics;
- the bad-step guard: a step whose loss, gradient or update was NaN/inf (the update found
  by a dry run of the AdamW step, `training.dry_step`) is skipped by the optimizer, counted,
  and never checkpointed (a checkpoint is only ever a good state); `trainer.max_bad_steps` of
  them in a row stop the run, naming the last good checkpoint;
- the reference sync (TR-DPO, `algorithm.ref_sync_steps` / `ref_sync_alpha`) for every
  task that has a reference;
- `final/`;
- data parallelism (a task with a `collective`: SFT, RM, DPO under torchrun with
  `trainer.strategy=ddp|fsdp2`): every rank runs the loop in step; only rank 0 claims the
  run directory, writes config.yaml, metrics and the progress bar; the wall-clock budget is
  agreed over the ranks (MAX) so all stop at the same step; every rank evaluates the whole
  held-out set (only rank 0's numbers are logged, which are the same); checkpoints and
  `final/` are written together (`OptimizerTask.save`).

`OptimizerTask` is the task of SFT, RM and DPO (one model, one optimizer, a batch stream
and a loss); the RL trainer is a task of its own (`trainers/rl.py`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain import distributed
from posttrain.checkpoint import (
    CHECKPOINTS,
    FINAL,
    RunModels,
    RunRecord,
    check_resume,
    claim_run_dir,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    save_final,
)
from posttrain.checkpoint import lock as run_lock
from posttrain.config import ConfigError, TrainerConfig, save_config, to_dict
from posttrain.config.inputs import recorded_config
from posttrain.logging import MetricsLogger, Progress, get_logger
from posttrain.models.loading import enable_gradient_checkpointing
from posttrain.models.lora import is_peft, merged_for_export
from posttrain.trainers.callbacks import Callbacks
from posttrain.trainers.preempt import Preemption
from posttrain.training.core import (
    BadStepGuard,
    LossFn,
    build_optimizer,
    build_scheduler,
    train_step,
)

log = get_logger(__name__)

SAMPLES_PER_EVAL = 16

Evaluate = Callable[[torch.nn.Module, int], tuple[dict[str, float], list[dict]]]
"""`evaluate(model, step) -> (metrics, samples)`, run without gradients in eval mode."""


@dataclass
class StepOutput:
    """What one step of a task did."""

    metrics: dict[str, float]
    nonfinite: bool = False
    """A loss, gradient or update of the step was NaN/inf (its optimizer step was skipped)."""
    skipped: bool = False
    """Nothing was trained (no units): neither counts as bad nor resets the guard."""
    overflow: bool = False
    """Of those, an update that would have made the weights NaN/inf from a finite loss and gradient."""
    progress: dict[str, float] = field(default_factory=dict)
    """A few numbers for the progress bar."""


@dataclass
class FitResult:
    """Where a finished run left things."""

    run_dir: Path
    final_dir: Path
    step: int
    metrics: dict[str, float]
    """The last step's metrics and the last evaluation's."""

    def held_out(self, names: tuple[str, ...]) -> str | None:
        """"held-out: loss=… accuracy=…" of the eval metrics `names` the run has, or None."""
        shown = [f"{k.removeprefix('eval/')}={self.metrics[k]:.4g}" for k in names if k in self.metrics]
        return "held-out: " + "  ".join(shown) if shown else None


class Task(Protocol):
    """What a trainer supplies to `run`."""

    desc: str
    """Progress-bar label (sft, rm, dpo, rl)."""
    start_metrics: Mapping[str, float]
    """Logged with the first step of a fresh run (e.g. data counts)."""
    has_eval: bool
    reference: Any
    """The reference when the task has one (for `ref_sync_steps`: its `shares_policy`), else None."""
    inputs: dict[str, Any] | None
    """What the Python API passed in place of config keys (`config.inputs`), for config.yaml."""

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def epoch(self) -> float:
        """Passes over the training data so far (fractional)."""
    @property
    def steps_per_epoch(self) -> float: ...
    def step(self, step: int) -> StepOutput: ...
    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]: ...
    def train_samples(self) -> list[dict]:
        """samples.jsonl rows of the step just run, written at each logged step ([] for none)."""
        ...
    def sync_reference(self, alpha: float) -> None:
        """TR-DPO: ref ← α·policy + (1 − α)·ref (`RefSync`)."""
    def save(self, run_dir: Path, step: int, metrics: dict[str, float], keep: int, run: RunRecord) -> Path: ...
    def restore(self, checkpoint: Path) -> int: ...
    def save_final(self, run_dir: Path) -> Path: ...


@dataclass
class RefSync:
    """TR-DPO's reference update (Gorbatovski et al. 2024, arXiv 2404.09656), as TRL's
    `sync_ref_model`: every `steps` optimizer steps, ref ← α·policy + (1 − α)·ref.
    `steps` 0 is off."""

    steps: int = 0
    alpha: float = 0.6

    def due(self, step: int) -> bool:
        return self.steps > 0 and step % self.steps == 0

    def check(self, reference: Any, sharded: bool = False) -> None:
        """Refuse before training what cannot be synced: no reference, a LoRA one, or a policy
        sharded by FSDP2 (its parameters are shards)."""
        if not self.steps:
            return
        if sharded:
            raise ConfigError("algorithm.ref_sync_steps: the policy is sharded (trainer.strategy=fsdp2) and the "
                              "reference is not; use trainer.strategy=ddp or algorithm.ref_sync_steps=0")
        if reference is None:
            raise ConfigError("algorithm.ref_sync_steps: this run has no reference model to sync")
        if reference.shares_policy:
            raise ConfigError("algorithm.ref_sync_steps: the reference of a LoRA run is the base model with "
                              "the adapter disabled, which cannot be synced (TRL refuses it with PEFT too); "
                              "set algorithm.ref_sync_steps=0 or train without LoRA (model.lora.r=0)")


class Budget:
    """`trainer.max_time_s`: wall-clock seconds since this object was made (the loop's
    start), checked at the end of each step; None never runs out."""

    def __init__(self, seconds: float | None, collective: Any = None):
        self.seconds, self.started, self.collective = seconds, time.perf_counter(), collective

    def spent(self, step: int) -> bool:
        """Past the budget; with data-parallel ranks, past it on any rank (all stop together)."""
        if self.seconds is None:
            return False
        over = time.perf_counter() - self.started >= self.seconds
        if self.collective is not None:
            over = self.collective.all_max([float(over)])[0] > 0
        if not over:
            return False
        log.info("trainer.max_time_s=%g reached at step %d: evaluating, saving and stopping", self.seconds, step)
        return True


def run(task: Task, config: Any, ref_sync: RefSync | None = None, callbacks: Callbacks | None = None) -> FitResult:
    """Train `task` for `config.trainer.max_steps` steps; see the module doc. `config` is the
    command's whole config tree (its class names the command, e.g. `SFTConfig.command`).
    The run directory is locked from before the start to after final/ (`checkpoint.lock`;
    rank 0 holds it for data-parallel ranks, the driver on Ray). SIGTERM and SIGUSR1 stop it
    at a sealed checkpoint and raise `Preempted` (`trainers/preempt.py`)."""
    main = getattr(task, "is_main", True)
    stop = Preemption(config.trainer.save_on_signal, getattr(task, "collective", None))
    with run_lock.hold(config.trainer.output_dir) if main else contextlib.nullcontext(), stop.installed():
        return _run(task, config, ref_sync, callbacks, stop)


def _run(task: Task, config: Any, ref_sync: RefSync | None, callbacks: Callbacks | None,
         stop: Preemption) -> FitResult:
    cfg: TrainerConfig = config.trainer
    hooks = callbacks if callbacks is not None else Callbacks([], config)
    run_dir = Path(cfg.output_dir)
    ref_sync = ref_sync or RefSync()
    collective = getattr(task, "collective", None)
    main = getattr(task, "is_main", True)
    ref_sync.check(task.reference, getattr(task, "sharded", False))
    config_dict = recorded_config(to_dict(config), getattr(task, "inputs", None))  # what Python passed, too
    signature = getattr(task, "model_signature", None)  # RL: from a worker (the driver holds no weights)
    record = RunRecord.of(config.command, config_dict, signature() if signature is not None else task.model)
    step, last_ckpt = _start(task, config, config_dict, record, main, collective)
    stop.at(step, last_ckpt)
    sink = MetricsLogger(run_dir, cfg.report_to, config_dict) if main else _NoSink()
    sink.truncate_after(step)
    guard = BadStepGuard(cfg.max_bad_steps)
    metrics: dict[str, float] = dict(task.start_metrics) if step == 0 else {}
    last_eval: dict[str, float] = {}
    evaluated_at = None
    budget = Budget(cfg.max_time_s, collective)
    preempted = False
    hooks.begin(task, config, step, main)
    asked = partial(hooks.agreed, collective=collective)  # a callback's control flag, agreed over ranks
    with sink, Progress(cfg.max_steps, task.desc, initial=step, enabled=cfg.progress and main,
                        max_seconds=cfg.max_time_s) as progress:
        while step < cfg.max_steps:
            hooks.step_begin()
            out = task.step(step + 1)
            step += 1
            guard.update(out, step, last_ckpt)
            metrics.update(out.metrics, nonfinite_steps=guard.total, epoch=task.epoch)
            if ref_sync.due(step) and not out.nonfinite:
                task.sync_reference(ref_sync.alpha)
            hooks.step_end(step, task.epoch)
            if task.has_eval and (cfg.eval_steps and step % cfg.eval_steps == 0 or asked("should_evaluate")):
                last_eval = _timed_eval(task, step, sink, hooks)
                metrics.update(last_eval)
                evaluated_at = step
            preempted = step < cfg.max_steps and stop.requested()  # at max_steps the run just finishes
            last = preempted or step == cfg.max_steps or budget.spent(step) or asked("should_training_stop")
            if step % cfg.logging_steps == 0 or evaluated_at == step or last or asked("should_log"):
                sink.log(step, metrics)
                _log_train_samples(task, step, sink)
                hooks.log(step, metrics)
                last = last or asked("should_training_stop")
            progress.update(1, **out.progress, **_eval_view(last_eval))
            due = cfg.save_steps and step % cfg.save_steps == 0 or last or asked("should_save")
            if due and not out.nonfinite:  # a checkpoint is only ever a good state
                last_ckpt = task.save(run_dir, step, metrics, cfg.save_total_limit, record)
                hooks.fire("on_save")
                preempted = preempted or step < cfg.max_steps and stop.requested()  # one during the save
            stop.at(step, last_ckpt)
            if last or preempted or asked("should_training_stop"):
                break
            metrics = {}
        if preempted:
            raise stop.stopped(step, last_ckpt, f"step {step}'s loss or gradient was NaN/inf" if out.nonfinite else "")
        if task.has_eval and evaluated_at != step:
            last_eval = _timed_eval(task, step, sink, hooks)
            sink.log(step, last_eval)
            metrics.update(last_eval)
    if step < cfg.max_steps:
        log.info("stopped at step %d of %d", step, cfg.max_steps)
    final_dir = task.save_final(run_dir)
    hooks.fire("on_train_end")
    log.info("finished at step %d; model in %s", step, final_dir)
    return FitResult(run_dir, final_dir, step, metrics)


def _start(task: Task, config: Any, config_dict: dict[str, Any], record: RunRecord, main: bool = True,
           collective: Any = None) -> tuple[int, Path | None]:
    """The resume step, before anything is written: find the checkpoint `trainer.resume`
    asks for (rank 0 checks its files' checksums and tells the other ranks) and check that
    it is one of this run (before any weights load), make the run directory this run's,
    write config.yaml (`config_dict`: rank 0 of data-parallel ranks; the others wait for
    it), then restore. Returns (step, checkpoint or None)."""
    cfg: TrainerConfig = config.trainer
    run_dir = Path(cfg.output_dir)
    resume_from = resolve_resume(run_dir, cfg.resume) if main else None  # reads every file: once
    if collective is not None:
        resume_from = _as_path(collective.broadcast(None if resume_from is None else str(resume_from)))
    changed = check_resume(resume_from, record, cfg.resume, cfg.max_steps) if resume_from is not None else []
    if main:
        claim_run_dir(run_dir, resume_from, cfg.resume, cfg.overwrite)
        save_config(config_dict, run_dir / "config.yaml")
    if collective is not None:
        collective.barrier()
    if resume_from is None:
        return 0, None
    if changed:
        log.info("resuming with changed settings: %s", "; ".join(changed))
    step = task.restore(resume_from)
    log.info("resumed from %s at step %d", resume_from, step)
    return step, resume_from


def _as_path(path: Any) -> Path | None:
    return None if path is None else Path(path)


class _NoSink:
    """The metrics sink of a data-parallel rank other than 0: it writes nothing."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...
    def log_samples(self, step: int, rows: list[dict]) -> None: ...
    def truncate_after(self, step: int) -> None: ...
    def __enter__(self) -> _NoSink:
        return self

    def __exit__(self, *exc: object) -> None: ...


def _timed_eval(task: Task, step: int, sink: MetricsLogger, hooks: Callbacks) -> dict[str, float]:
    t0 = time.perf_counter()
    metrics, samples = task.evaluate(step)
    if samples:
        sink.log_samples(step, samples)
    out = {**metrics, "timing/eval": time.perf_counter() - t0}
    hooks.fire("on_evaluate", metrics=dict(out))
    return out


def _log_train_samples(task: Task, step: int, sink: MetricsLogger) -> None:
    """The task's training samples of this step (RL: the batch's first rows), if it has any."""
    rows = task.train_samples()
    if rows:
        sink.log_samples(step, rows)


def _eval_view(metrics: Mapping[str, float]) -> dict[str, float]:
    keys = ("eval/loss", "eval/accuracy")
    return {k.replace("/", "_"): metrics[k] for k in keys if k in metrics}


# ---------------------------------------------------------------------------- SFT, RM, DPO


class BatchStream(Protocol):
    """Yields each optimizer step's micro-batches; its state is saved in checkpoints."""

    def next_step(self) -> list[Any]: ...
    @property
    def epoch_progress(self) -> float: ...
    @property
    def steps_per_epoch(self) -> float: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class OptimizerTask:
    """One model trained by one AdamW on a batch stream's micro-batches with a loss
    (the `train_step` contract): the task of SFT, the reward model and DPO.

    `evaluate(model, step) -> (metrics, samples)` runs every `trainer.eval_steps` and at the
    end (the first `SAMPLES_PER_EVAL` samples go to samples.jsonl). `reference`, when the
    loss has one, is synced by the loop and saved in checkpoints once it has been synced.

    Data parallelism (`trainer.strategy` ddp|fsdp2, in a process group `distributed.init_from_env`
    joined): the model is wrapped (`distributed.wrap`), the stream yields this rank's slice of
    each global batch, `train_step` all-reduces the normalisation and the metrics, and
    checkpoints hold the model and optimizer as DCP shards (`_save_sharded`) beside the
    gathered HF folder. ddp|fsdp2 in one process (no group) trains as `none` but writes the
    same sharded checkpoints, so a run can resume at any number of ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        cfg: TrainerConfig,
        batches: BatchStream,
        loss_fn: LossFn,
        evaluate: Evaluate | None = None,
        start_metrics: Mapping[str, float] | None = None,
        desc: str = "train",
        reference: Any = None,
        unit: str = "tokens",
        inputs: dict[str, Any] | None = None,
    ):
        self._model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.inputs = inputs
        self.unit = unit  # what the loss's n_units count: the metric n_<unit>
        self.batches, self.loss_fn, self._evaluate = batches, loss_fn, evaluate
        self.start_metrics = dict(start_metrics or {})
        self.desc, self.reference = desc, reference
        self.has_eval = evaluate is not None
        self.strategy = getattr(cfg, "strategy", "none")
        self.dist = distributed.current() if self.strategy != "none" else None
        self.wrapped = distributed.wrap(model, self.strategy, self.dist)
        self.collective = distributed.Collective(self.dist.world_size, self.dist.device) if self.dist else None
        self.is_main = self.dist is None or self.dist.is_main
        self.sharded = self.wrapped.sharded
        if self.dist is not None:
            batches.shard(self.dist.rank, self.dist.world_size, self.collective)
        self.optimizer = build_optimizer(model, cfg)  # after wrapping: FSDP2's parameters are shards
        self.scheduler = build_scheduler(self.optimizer, cfg, cfg.max_steps)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def epoch(self) -> float:
        return self.batches.epoch_progress

    @property
    def steps_per_epoch(self) -> float:
        return self.batches.steps_per_epoch

    def _loss(self, model: torch.nn.Module, batch: Any) -> Any:
        return self.wrapped.loss(self.loss_fn, batch)

    def step(self, step: int) -> StepOutput:
        t0 = time.perf_counter()
        self.model.train()
        micro_batches = self.batches.next_step()
        result = train_step(self.model, micro_batches, self._loss, self.optimizer, self.scheduler,
                            self.cfg.max_grad_norm, self.cfg.precision, self.collective)
        timing = _throughput(micro_batches, time.perf_counter() - t0, self.collective)
        metrics = {**result.as_metrics(self.unit), **timing}
        return StepOutput(metrics, result.nonfinite, result.skipped, result.overflow,
                          {"loss": result.loss, "lr": result.lr})

    def train_samples(self) -> list[dict]:
        """None: SFT, RM and DPO write samples at eval steps only."""
        return []

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        assert self._evaluate is not None
        self.model.eval()
        with torch.no_grad(), self.wrapped.gathered():
            metrics, samples = self._evaluate(self.model, step)
        self.model.train()
        return metrics, samples[:SAMPLES_PER_EVAL]

    def sync_reference(self, alpha: float) -> None:
        self.reference.sync(self.model, alpha)

    def save(self, run_dir: Path, step: int, metrics: dict[str, float], keep: int, run: RunRecord) -> Path:
        ref = self.reference.saved_model() if self.reference is not None else None
        if self.strategy != "none":
            return self._save_sharded(run_dir, step, metrics, keep, run, ref)
        return save_checkpoint(run_dir, step, RunModels(self.model, reference=ref), self.tokenizer, self.optimizer, self.scheduler,
                               self.batches.state_dict(), keep, metrics, run)

    def _save_sharded(self, run_dir: Path, step: int, metrics: dict[str, float], keep: int, run: RunRecord,
                      ref: torch.nn.Module | None) -> Path:
        """Every rank: its DCP shard of model + optimizer into the unsealed folder rank 0 made;
        rank 0: the gathered model as the HF folder, trainer_state (scheduler, RNG, data
        position), and the seal only once every rank has written (a barrier)."""
        full = self.wrapped.full_model()  # collective under fsdp2
        path = Path(run_dir) / CHECKPOINTS / f"step-{step}"
        if self.is_main:
            path = save_checkpoint(run_dir, step, RunModels(full, reference=ref), self.tokenizer, None, self.scheduler,
                                   self.batches.state_dict(), keep, metrics, run, self._write_shards)
        else:
            self._write_shards(None)
        if self.collective is not None:
            self.collective.barrier()  # rank 0 has sealed and published it
        return path

    def _write_shards(self, folder: Path | None) -> None:
        if self.collective is not None:
            folder = Path(self.collective.broadcast(str(folder) if folder is not None else None))
        assert folder is not None
        distributed.save_sharded(folder / distributed.SHARDS, self.model, self.optimizer)
        if self.collective is not None:
            self.collective.barrier()  # every rank's shard is on disk before rank 0 seals

    def restore(self, checkpoint: Path) -> int:
        if self.strategy != "none":
            shards = checkpoint / distributed.SHARDS
            if not shards.is_dir():
                raise ValueError(f"checkpoint {checkpoint} has no DCP shards ({distributed.SHARDS}/): it was "
                                 f"written with trainer.strategy=none, and this run uses {self.strategy}")
            state = load_checkpoint(checkpoint, None, None, self.scheduler)
            distributed.load_sharded(shards, self.model, self.optimizer)
        else:
            state = load_checkpoint(checkpoint, self.model, self.optimizer, self.scheduler)
        self.batches.load_state_dict(state["data_state"])
        if self.reference is not None:
            RunModels.load_reference(checkpoint, self.reference)
        return state["step"]

    def save_final(self, run_dir: Path) -> Path:
        full = self.wrapped.full_model()  # collective under fsdp2; None on ranks but 0
        final_dir = Path(run_dir) / FINAL
        if full is not None:  # with LoRA: the merged model, and the adapter alone in adapter/ for peft users
            models = RunModels(merged_for_export(full), adapter=full if is_peft(full) else None)
            final_dir = save_final(run_dir, models, self.tokenizer)
        if self.collective is not None:
            self.collective.barrier()
        return final_dir


def fit(
    model: torch.nn.Module,
    tokenizer: Any,
    config: Any,
    batches: BatchStream,
    loss_fn: LossFn,
    evaluate: Evaluate | None = None,
    start_metrics: Mapping[str, float] | None = None,
    desc: str = "train",
    reference: Any = None,
    ref_sync: RefSync | None = None,
    unit: str = "tokens",
    callbacks: Callbacks | None = None,
    inputs: dict[str, Any] | None = None,
) -> FitResult:
    """`run` an `OptimizerTask` (see both); `config` is the command's config tree; `unit`
    names what loss_fn's n_units count; `inputs`: what the Python API passed (`config.inputs`).
    `model.gradient_checkpointing` is switched on here, before any wrapping."""
    if config.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    task = OptimizerTask(model, tokenizer, config.trainer, batches, loss_fn, evaluate, start_metrics, desc, reference,
                         unit, inputs)
    return run(task, config, ref_sync, callbacks)


def _throughput(micro_batches: list[Any], seconds: float, collective: Any = None) -> dict[str, float]:
    """Input tokens per second of the step, padding excluded (each batch's `num_tokens()`);
    with data-parallel ranks, all ranks' tokens over the slowest rank's seconds."""
    tokens = sum(mb.num_tokens() for mb in micro_batches)
    if collective is not None:
        tokens, seconds = collective.all_sum([tokens])[0], collective.all_max([seconds])[0]
    return {"timing/step": seconds, "throughput/tokens_per_s": tokens / max(seconds, 1e-9)}
