"""The optimisation loop shared by the SFT, reward-model and DPO trainers.

    resume? → for each step: batch → train_step → guard → metrics → eval? → checkpoint? → final/

A trainer brings a `BatchStream` (what the next step's micro-batches are, and where the
data stands, for exact resume), a loss function (the `train_step` contract) and an
optional evaluation; everything else — optimizer, schedule, NaN guard, metric sinks,
progress bar, checkpoints, resume — is here, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.checkpoint import load_checkpoint, resolve_resume, save_checkpoint, save_final
from posttrain.config import TrainerConfig
from posttrain.logging import MetricsLogger, Progress, get_logger
from posttrain.models.lora import is_peft, merged_for_export
from posttrain.trainers.core import (
    BadStepGuard,
    LossFn,
    build_optimizer,
    build_scheduler,
    train_step,
)

log = get_logger(__name__)

SAMPLES_PER_EVAL = 16


class BatchStream(Protocol):
    """Yields each optimizer step's micro-batches; its state is saved in checkpoints."""

    def next_step(self) -> list[Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class FitResult:
    """Where a finished run left things."""

    run_dir: Path
    final_dir: Path
    step: int
    metrics: dict[str, float]
    """The last step's metrics and the last evaluation's."""


class Budget:
    """`trainer.max_time_s`: wall-clock seconds since this object was made (the loop's
    start), checked at the end of each step; None never runs out."""

    def __init__(self, seconds: float | None):
        self.seconds, self.started = seconds, time.perf_counter()

    def spent(self, step: int) -> bool:
        if self.seconds is None or time.perf_counter() - self.started < self.seconds:
            return False
        log.info("trainer.max_time_s=%g reached at step %d: evaluating, saving and stopping", self.seconds, step)
        return True


def fit(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: TrainerConfig,
    batches: BatchStream,
    loss_fn: LossFn,
    evaluate: Callable[[torch.nn.Module, int], tuple[dict[str, float], list[dict]]] | None = None,
    config_dict: Mapping[str, Any] | None = None,
    start_metrics: Mapping[str, float] | None = None,
    desc: str = "train",
) -> FitResult:
    """Train `model` for `cfg.max_steps` optimizer steps; see the module doc.

    `evaluate(model, step) -> (metrics, samples)` runs every `cfg.eval_steps` steps and at
    the end; the first `SAMPLES_PER_EVAL` samples go to samples.jsonl.
    `start_metrics` (e.g. data truncation counts) are logged with the first step.
    """
    run_dir = Path(cfg.output_dir)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, cfg.max_steps)
    step, last_ckpt = 0, None
    resume_from = resolve_resume(run_dir, cfg.resume)
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, scheduler)
        step, last_ckpt = state["step"], resume_from
        batches.load_state_dict(state["data_state"])
        log.info("resumed from %s at step %d", resume_from, step)
    sink = MetricsLogger(run_dir, cfg.report_to, config_dict)
    sink.truncate_after(step)
    guard = BadStepGuard(cfg.max_bad_steps)
    metrics: dict[str, float] = dict(start_metrics or {})
    last_eval: dict[str, float] = {}
    evaluated_at = None
    budget = Budget(cfg.max_time_s)
    with sink, Progress(cfg.max_steps, desc, initial=step, enabled=cfg.progress) as progress:
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            model.train()
            micro_batches = batches.next_step()
            result = train_step(
                model, micro_batches, loss_fn, optimizer, scheduler, cfg.max_grad_norm, cfg.precision
            )
            step += 1
            guard.update(result, step, last_ckpt)
            elapsed = time.perf_counter() - t0
            metrics.update(result.as_metrics())
            metrics.update(_throughput(micro_batches, elapsed), nonfinite_steps=guard.total)
            if evaluate is not None and cfg.eval_steps and step % cfg.eval_steps == 0:
                last_eval = _timed_eval(evaluate, model, step, sink)
                metrics.update(last_eval)
                evaluated_at = step
            last = step == cfg.max_steps or budget.spent(step)
            if step % cfg.logging_steps == 0 or evaluated_at == step or last:
                sink.log(step, metrics)
            progress.update(1, loss=result.loss, lr=result.lr, **_eval_view(last_eval))
            due = cfg.save_steps and step % cfg.save_steps == 0 or last
            if due and not result.nonfinite:  # a checkpoint is only ever a good state
                last_ckpt = save_checkpoint(
                    run_dir, step, model, tokenizer, optimizer, scheduler,
                    batches.state_dict(), cfg.save_total_limit, metrics,
                )
            metrics = {}
            if last:
                break
        if evaluate is not None and evaluated_at != step:
            last_eval = _timed_eval(evaluate, model, step, sink)
            sink.log(step, last_eval)
        metrics.update(last_eval)
    final_dir = save_final(run_dir, merged_for_export(model), tokenizer)
    if is_peft(model):
        model.save_pretrained(final_dir / "adapter")  # the adapter alone, for peft users
    log.info("finished at step %d; model in %s", step, final_dir)
    return FitResult(run_dir, final_dir, step, metrics)


def _timed_eval(evaluate: Callable, model: torch.nn.Module, step: int, sink: MetricsLogger) -> dict[str, float]:
    t0 = time.perf_counter()
    model.eval()
    with torch.no_grad():
        metrics, samples = evaluate(model, step)
    model.train()
    if samples:
        sink.log_samples(step, samples[:SAMPLES_PER_EVAL])
    return {**metrics, "timing/eval": time.perf_counter() - t0}


def _throughput(micro_batches: list[Any], seconds: float) -> dict[str, float]:
    """Input tokens per second of the step, padding excluded (each batch's `num_tokens()`)."""
    tokens = sum(mb.num_tokens() for mb in micro_batches)
    return {"timing/step": seconds, "throughput/tokens_per_s": tokens / max(seconds, 1e-9)}


def _eval_view(metrics: Mapping[str, float]) -> dict[str, float]:
    keys = ("eval/loss", "eval/accuracy")
    return {k.replace("/", "_"): metrics[k] for k in keys if k in metrics}
