"""The training core every trainer (SFT, reward model, DPO, RL) shares.

Small functions, no base class: seeding, the AdamW optimizer, the learning-rate
schedule, bf16 autocast, one optimizer step over several micro-batches
(`train_step`, which skips a step whose loss, gradient or update is NaN/inf), and a guard
that stops a run whose steps keep being skipped so.

Gradient accumulation is normalised by units (tokens) across the whole step,
not per micro-batch: each micro-batch backpropagates the *sum* of its per-unit
losses, and the accumulated gradient is divided once by the step's total unit
count before clipping. k micro-batches of b sequences therefore give exactly the
update of one batch of k·b sequences, however the padding falls. A mean of
per-micro-batch token-means (HF Trainer before transformers 4.46) weights the
tokens of a short micro-batch more than those of a long one.

Departure from transformers' schedules: none in value (`build_scheduler`
matches `get_{cosine,linear,constant}_schedule_with_warmup`, with
`min_lr_ratio` as in `get_cosine_with_min_lr_schedule_with_warmup`), except
that the decay holds at its floor after `total_steps` (transformers' cosine rises again).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from posttrain.config.core import RunStopped
from posttrain.config.sections import TrainerConfig
from posttrain.training.dry_step import update_finite

LossFn = Callable[
    [torch.nn.Module, Any], tuple[torch.Tensor, int | torch.Tensor, Mapping[str, Any]]
]
"""`loss_fn(model, micro_batch) -> (loss_sum, n_units, metrics)`; see `train_step`."""


class StepCollective(Protocol):
    """The all-reduces `train_step` needs across data-parallel ranks
    (`posttrain.distributed.Collective`; see its module doc for why each is needed)."""

    world_size: int

    def all_sum(self, values: list[float]) -> list[float]: ...
    def all_max(self, values: list[float]) -> list[float]: ...
    def reduce_metrics(self, n_units: float | Mapping[str, float], metrics: Mapping[str, float]) -> dict[str, float]: ...
    def sync_gradients(self, params: list[torch.Tensor]) -> None: ...


class TrainingDiverged(RunStopped):
    """The loss, gradient norm or update was NaN/inf for `trainer.max_bad_steps` steps in a row."""


def set_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (`requires_grad`), tied ones counted once.

    Weight decay applies to matrices only (ndim ≥ 2: linear and embedding
    weights); 1-D parameters (norm scales, biases) get none, as in HF Trainer.
    `foreach`/`fused` are left to torch's defaults.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        if params
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps
    )


def lr_factor(
    step: int, kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> float:
    """Multiplier of the peak learning rate for the optimizer step with 0-based index `step`.

    Warmup (step < W): step / W, so the first step runs at lr 0 as in transformers.
    Then, with progress p = min(1, (step − W) / max(1, total_steps − W)) and m = min_lr_ratio:
        cosine:   m + (1 − m) · ½ (1 + cos(π p))
        linear:   m + (1 − m) · (1 − p)
        constant: 1
    """
    if step < warmup_steps:
        return step / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif kind == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"unknown lr_scheduler {kind!r}; choose cosine, linear or constant")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`trainer.lr_scheduler` with linear warmup, as a LambdaLR (see `lr_factor`).

    Call `scheduler.step()` once after each optimizer step; `train_step` does. `total_steps`
    is the schedule's span when it is `cfg.max_steps`; `trainer.lr_schedule_steps` stretches
    it by the same offset (an actor that starts after the critic's warmup keeps its shift).
    """
    lr_factor(0, cfg.lr_scheduler, 0, 1)  # reject an unknown kind now, not at the first step
    if cfg.lr_schedule_steps is not None:
        total_steps = cfg.lr_schedule_steps - (cfg.max_steps - total_steps)

    def factor(step: int) -> float:
        return lr_factor(step, cfg.lr_scheduler, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """`trainer.precision` for `device`: "auto" -> "bf16" on a CUDA device that supports
    bfloat16, else "fp32"; "fp32" | "bf16" -> itself."""
    if precision == "auto":
        on_cuda = torch.device(device).type == "cuda"
        return "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"unknown precision {precision!r}; choose auto, fp32 or bf16")
    return precision


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast on `device` when precision resolves to `bf16`; a no-op for `fp32`.

    Master weights and gradients stay in fp32; only the forward's matmuls run in bf16.
    """
    if resolve_precision(precision, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@dataclass
class StepResult:
    """What one optimizer step did."""

    loss: float
    """Σ loss_sum / Σ n_units over the step's micro-batches (nan/inf when it was not finite)."""
    grad_norm: float
    """Global L2 norm of the unit-normalised gradient, before clipping (nan when not computed)."""
    lr: float
    """Learning rate of the first param group during this step."""
    n_tokens: int
    """Σ n_units: tokens for a token-mean loss (or whatever unit the loss_fn counts)."""
    skipped: bool = False
    """True when the optimizer and scheduler were not stepped (see `nonfinite`)."""
    nonfinite: bool = False
    """The loss or gradient norm was NaN/inf, or the update would have made a weight NaN/inf
    (`overflow`); the step was skipped. A step with no units at all is skipped too, but is not
    counted as non-finite."""
    overflow: bool = False
    """The loss and gradient were finite but the update was not (a weight near the float
    range pushed past it, a huge learning rate): found by a dry run of the step
    (`dry_step.update_finite`) and skipped like a NaN loss."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss_fn's metrics merged over micro-batches (see `merge_metrics`)."""

    def as_metrics(self, unit: str = "tokens") -> dict[str, float]:
        """Flat dict for the metrics logger: loss, grad_norm, lr, n_<unit> (Σ n_units, named
        for what the loss_fn counts: n_tokens, n_pairs), then the loss_fn's."""
        return {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            f"n_{unit}": self.n_tokens,
            **self.metrics,
        }


def merge_metrics(parts: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[str, float]:
    """Merge per-micro-batch metrics `(n_units, {name: value})` into one dict.

    Names ending in `/max` or `/min` take the max / min; every other metric is
    averaged weighted by n_units, so a per-micro-batch mean becomes the step's
    mean (a plain mean when the micro-batches reporting it have no units).
    """
    parts = [(n, {k: float(v) for k, v in m.items()}) for n, m in parts]
    merged: dict[str, float] = {}
    for name in dict.fromkeys(k for _, m in parts for k in m):
        seen = [(n, m[name]) for n, m in parts if name in m]
        values = [v for _, v in seen]
        units = sum(n for n, _ in seen)
        if name.endswith("/max"):
            merged[name] = max(values)
        elif name.endswith("/min"):
            merged[name] = min(values)
        elif units > 0:
            merged[name] = sum(n * v for n, v in seen) / units
        else:
            merged[name] = sum(values) / len(values)
    return merged


def train_step(
    model: torch.nn.Module,
    micro_batches: Iterable[Any],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    max_grad_norm: float,
    precision: str = "fp32",
    collective: StepCollective | None = None,
) -> StepResult:
    """One optimizer step over `micro_batches`, gradients normalised by units across all of them.

    Contract of `loss_fn(model, micro_batch) -> (loss_sum, n_units, metrics)`:
      - loss_sum: 0-dim tensor, the *sum* (not the mean) of the per-unit losses
        of this micro-batch, e.g. Σ_t ce_t · mask_t for a token-mean loss.
      - n_units: how many units that sum covers (int or 0-dim tensor), e.g. Σ mask.
        Units are tokens for a token-mean loss; for a sequence-mean loss return
        Σ_seq (seq loss) and the number of sequences. Padding must count 0.
      - metrics: {name: float or 0-dim tensor}, merged by `merge_metrics`.
    The step's loss is Σ loss_sum / Σ n_units, exactly the loss of one batch that
    held all the micro-batches: each loss_sum is backpropagated as is, and the
    summed gradient is divided by Σ n_units before clipping to `max_grad_norm`
    (0 turns clipping off). The forward runs under `autocast(precision)`.

    When the loss or the gradient norm is NaN/inf, when the update would make a weight
    NaN/inf (a dry run of the step, `dry_step.update_finite`), or when the step has no units,
    the gradients are dropped and neither the optimizer nor the scheduler is stepped
    (`skipped=True`): weights and optimizer state stay bit for bit as they were; feed the
    result to `BadStepGuard.update`.
    Gradients are None on return. Not done here: `model.train()`.

    Data-parallel (`collective` given; the model is DDP/FSDP2-wrapped, so the backward
    averages gradients over the W ranks): every rank runs max_r(#micro-batches) passes,
    repeating its last micro-batch with weight 0 where it has fewer; Σ n_units and Σ loss_sum
    are all-reduced, and the averaged gradient is divided by N / W, N the global Σ n_units,
    so the update is the one of the whole global batch in one process. The metrics are
    reduced over ranks (`collective.reduce_metrics`); `n_tokens` is the global N.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = params[0].device
    optimizer.zero_grad(set_to_none=True)
    micro_batches = list(micro_batches)
    passes = len(micro_batches)
    if collective is not None:
        passes = int(collective.all_max([passes])[0])
    loss_sums, parts, n_total = [], [], 0
    for i in range(passes):
        real = i < len(micro_batches)
        with autocast(precision, device):
            loss_sum, n_units, metrics = loss_fn(model, micro_batches[min(i, len(micro_batches) - 1)])
        if not real:  # an extra pass so every rank runs as many collectives; it weighs nothing
            loss_sum = loss_sum * 0.0
        if loss_sum.requires_grad:  # a micro-batch with nothing to learn may return a constant
            loss_sum.backward()
        if real:
            loss_sums.append(loss_sum.detach().double())
            n_total += int(n_units)
            parts.append((int(n_units), metrics))
    if collective is not None:  # averages the gradients unless a DDP / FSDP2 backward did
        collective.sync_gradients(params)
    lr = float(optimizer.param_groups[0]["lr"])
    merged = merge_metrics(parts)
    loss_total: torch.Tensor | float = torch.stack(loss_sums).sum() if loss_sums else 0.0
    scale = n_total
    if collective is not None:
        n_global, loss_total = collective.all_sum([n_total, float(loss_total)])
        units = {k: float(sum(n for n, m in parts if k in m)) for k in merged}  # as merge_metrics weighs them
        merged = collective.reduce_metrics(units, merged)
        n_total = int(n_global)
        scale = n_total / collective.world_size  # the backward averaged over the ranks
    if n_total == 0:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(0.0, math.nan, lr, 0, skipped=True, metrics=merged)

    for p in params:
        if p.grad is not None:
            p.grad.div_(scale)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        params, max_grad_norm if max_grad_norm > 0 else math.inf
    )
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over the shards
        grad_norm = grad_norm.full_tensor()
    mean_loss = torch.as_tensor(loss_total, dtype=torch.float64, device=device) / n_total
    loss, norm = torch.stack([mean_loss, grad_norm.double().to(device)]).tolist()  # one device sync
    nonfinite = not (math.isfinite(loss) and math.isfinite(norm))
    overflow = not nonfinite and not update_finite(optimizer, collective)
    if not (nonfinite or overflow):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, norm, lr, n_total, skipped=nonfinite or overflow, nonfinite=nonfinite or overflow,
                      overflow=overflow, metrics=merged)


class BadStepGuard:
    """Counts consecutive non-finite steps and stops the run after `max_bad_steps` in a row.

    Non-finite: a NaN/inf loss or gradient norm, or an update that would have overflowed a
    weight (`StepResult.overflow`); each was skipped, so the weights are still the last good
    ones. A good step resets the count; a step skipped only for having no units neither
    counts nor resets. `total` counts every non-finite step of the run.
    """

    def __init__(self, max_bad_steps: int):
        if max_bad_steps < 1:
            raise ValueError(f"trainer.max_bad_steps must be >= 1, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.consecutive = 0
        self.overflows = 0
        self.total = 0

    def update(
        self, result: StepResult, step: int, last_checkpoint: Path | str | None = None
    ) -> None:
        """Record optimizer step `step`'s result; raise `TrainingDiverged` at the limit."""
        if not result.nonfinite:
            if not result.skipped:
                self.consecutive = self.overflows = 0
            return
        self.consecutive += 1
        self.overflows += result.overflow
        self.total += 1
        if self.consecutive >= self.max_bad_steps:
            where = last_checkpoint if last_checkpoint is not None else "none (nothing saved yet)"
            cause = "the loss or gradient norm was NaN/inf"
            if self.overflows:
                cause = (f"the loss, gradient norm or update was NaN/inf ({self.overflows} of them an update that "
                         "would have overflowed the weights, from a finite loss and gradient)")
            raise TrainingDiverged(
                f"{cause} for {self.consecutive} consecutive steps at step {step}, each skipped; lower "
                f"trainer.learning_rate or check the data; the last good checkpoint is at {where}"
            )
