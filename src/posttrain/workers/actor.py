"""The actor role: the policy model, its optimizer and schedule, log-probs and the PPO update.

Notation: B rows, Tr response tokens, V vocab. One `update(batch)`:

    for epoch in 1..ppo_epochs:
        rows shuffled (seeded), cut in mini-batches of ppo_mini_batch_size · n rows
        for each mini-batch: ONE optimizer step (`training.core.train_step`) whose gradient
            accumulates over micro-batches; micro-batch k contributes w_k · L_k with
            w_k = aggregation_weight(mask_k) and train_step divides by Σ w_k, so the step
            equals one pass over the whole mini-batch whatever the micro-batch size and
            whichever rows go together: micro-batches are cut from the mini-batch's rows
            sorted by length, so each is trimmed of more padding.
    scheduler.step()  (the learning-rate schedule counts RL steps, as veRL's)

Loss of a micro-batch (each term reduced with the same `loss_agg_mode`, which is what
makes the weighted combination exact):
    L = policy_loss(logp, old_logp, adv, w) − entropy_coeff · H + β · KL(logp, ref_logp)
(old_logp = sg[logp] when the batch has none: a single on-policy step), with the KL
term only when `algorithm.kl.in_loss`. w, the batch's `rollout_is_weights` when the rollout
correction is on, multiplies the policy-gradient term only (as veRL: not the entropy, KL or
value terms). The policy runs in whatever mode it
is in (train); RL models should have no dropout, or the first ratio is not exactly 1.

Rows that cannot move the policy get no forward pass. When the loss is the clipped
surrogate alone (entropy_coeff 0, no KL in the loss, no shared value head), a row whose
advantage is 0 on every valid token has ℓ_t = max(−0·r, −0·clip(r)) = 0 and a gradient of
exactly 0, whatever its ratio: a GRPO group whose rewards are all equal is such a group
(often most of a batch). Those rows go into one `ZeroAdvantageRows` part of the step that
contributes its aggregation weight w (the denominator) and a loss of 0, so the optimizer
step is the one of the whole mini-batch. When no other row is left, 0 · Σθ gives every
parameter its exact gradient, 0, and AdamW steps on its moments as it would. Only metrics
differ: `entropy` is a mean over the rows that ran (a step that ran none logs the value of
a stage that did not run, `rl_steps.NOT_RUN`), and so are the ratio metrics (clip_frac*,
approx_kl, ratio/mean) off-policy; on-policy the skipped rows' ratio is 1, which they
report. An off-policy mini-batch with no row to run runs them all, since only a forward
gives its ratio metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from posttrain.algos import (
    aggregate_loss,
    aggregation_weight,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    policy_loss,
    token_logprobs,
)
from posttrain.config.rl import RLConfig
from posttrain.models.loading import enable_gradient_checkpointing, is_sharded
from posttrain.training.core import (
    StepCollective,
    StepResult,
    autocast,
    build_optimizer,
    build_scheduler,
    train_step,
)
from posttrain.workers.batch import RLBatch
from posttrain.workers.forward import (
    FORWARD_FIELDS,
    builtin_of,
    check_packing_support,
    device_of,
    micro_batches,
    per_token_pass,
    response_logits,
)


@dataclass
class ZeroAdvantageRows:
    """Rows of a mini-batch whose advantage is 0 on every valid token: part of the optimizer
    step through their aggregation weight only (module docstring); no forward pass."""

    batch: RLBatch
    only_part: bool
    """Nothing else runs in the step: the loss then gives every parameter a zero gradient."""


JointForward = Callable[[nn.Module, RLBatch], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]
"""`joint(policy, micro_batch) -> (logits (b, tr, V), loss term, metrics)`: replaces the
actor's forward and adds a term to its loss (a value head on the policy's backbone)."""


class Actor:
    """The policy being trained (TRL's `model`; veRL's actor worker).

    Args:
        model: the policy (BuiltinLM, transformers causal LM, or peft-wrapped).
        cfg: the run's config, read where it is: `actor.*` (loss, micro-batches, entropy),
            `rollout.temperature` and `rollout.max_response_tokens()` (the L of
            seq-mean-token-sum-norm: max_new_tokens, or an episode's most model tokens),
            `algorithm.kl` (a KL term in the loss), `trainer.*`
            (optimizer, schedule, clipping, precision; trainer.learning_rate is the actor's).
        total_steps: RL steps the schedule spans.
        extra_params: more parameters for the actor's optimizer (a shared value head).
        collective: the data-parallel group of a Ray worker (None: one process).
        episodes: the responses are multi-turn episodes (an environment given in Python).
    """

    def __init__(self, model: nn.Module, cfg: RLConfig, total_steps: int, extra_params: nn.Module | None = None,
                 collective: StepCollective | None = None, episodes: bool = False):
        self.model, self.cfg = model, cfg
        self.collective = collective
        """Set on a data-parallel worker (the Ray backend): each optimizer step all-reduces
        its normalisation, gradients and metrics (`train_step`), so a worker's share of a
        mini-batch gives the whole mini-batch's update."""
        self.a, self.loss_cfg, self.kl = cfg.actor, cfg.actor.policy_loss, cfg.algorithm.kl
        self.temperature, self.max_len = cfg.rollout.temperature, cfg.rollout.max_response_tokens(episodes)
        self.joint: JointForward | None = None
        self.remove_padding = cfg.model.use_remove_padding
        if self.remove_padding and builtin_of(model) is None:
            check_packing_support(model)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.skip_zero_rows = cfg.trainer.strategy != "fsdp2"
        """Rows with zero advantages skip the forward (module doc), except under fsdp2, where
        every worker's forward takes part in the all-gathers (the local run does as fsdp2's,
        so their metrics agree too)."""
        owner = model if extra_params is None else nn.ModuleList([model, extra_params])
        self.optimizer = build_optimizer(owner, cfg.trainer)
        self.scheduler = build_scheduler(self.optimizer, cfg.trainer, total_steps)
        self.steps = 0

    @property
    def device(self) -> torch.device:
        return device_of(self.model)

    @property
    def lr(self) -> float:
        """The learning rate the next update will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def micro_batches(self, batch: RLBatch) -> list[RLBatch]:
        """The update's micro-batches: rows of similar length together (less padding)."""
        return micro_batches(batch, self.a.micro_batch_size, self.a.max_tokens_per_micro_batch, self.device,
                             by_length=True, packed=self.remove_padding)

    @property
    def loss_is_surrogate_only(self) -> bool:
        """No entropy, KL or value term: a row with zero advantages has zero loss and gradient."""
        return self.a.entropy_coeff == 0 and not self.kl.in_loss and self.joint is None

    def update_parts(self, mini: RLBatch) -> list[RLBatch | ZeroAdvantageRows]:
        """The parts of one optimizer step over `mini`: micro-batches of the rows that move
        the policy, then the others as one `ZeroAdvantageRows` (when the loss allows it)."""
        if not (self.loss_is_surrogate_only and self.skip_zero_rows):
            return self.micro_batches(mini)
        moves = ((mini.advantages != 0) & mini.response_mask.bool()).any(-1)  # (B,)
        if bool(moves.all()) or (not bool(moves.any()) and mini.old_logp is not None):
            return self.micro_batches(mini)
        parts = self.micro_batches(mini.select(moves)) if bool(moves.any()) else []
        return [*parts, ZeroAdvantageRows(mini.select(~moves), only_part=not parts)]

    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr) log softmax(logits / T)[y_t] of the current policy, 0 on padding (CPU).
        Needs the forward's fields (`FORWARD_FIELDS`)."""
        batch.require(*FORWARD_FIELDS, role="actor.compute_logprobs")

        def logp(mb: RLBatch) -> torch.Tensor:
            return token_logprobs(response_logits(self.model, mb, self.remove_padding), mb.response_ids,
                                  self.temperature)

        # Under the update's autocast: a first-step ratio of exactly 1 needs the same numerics.
        with autocast(self.cfg.trainer.precision, self.device):
            (out,) = per_token_pass(batch, logp, self.a.micro_batch_size, self.a.max_tokens_per_micro_batch, self.device,
                                    packed=self.remove_padding,
                                    collective=self.collective if is_sharded(self.model) else None)
        return out

    def loss(
        self, model: nn.Module, mb: RLBatch | ZeroAdvantageRows, kl_coef: float
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The `train_step` contract: (w · L, w, metrics) with w = aggregation_weight(mask)."""
        a, pl, agg = self.a, self.loss_cfg, self.loss_cfg.loss_agg_mode
        if isinstance(mb, ZeroAdvantageRows):
            return self.zero_advantage_loss(model, mb)
        mask = mb.response_mask
        extra, extra_metrics = None, {}
        if self.joint is None:
            logits = response_logits(model, mb, self.remove_padding)
        else:
            logits, extra, extra_metrics = self.joint(model, mb)
        logp = token_logprobs(logits, mb.response_ids, self.temperature)
        old_logp = mb.old_logp if mb.old_logp is not None else logp.detach()  # on-policy: ratio 1
        loss, metrics = policy_loss(
            logp, old_logp, mb.advantages, mask, pl.clip_low, pl.clip_high, pl.dual_clip, pl.level, agg, self.max_len,
            mb.rollout_is_weights,
        )
        metrics["policy_loss"] = loss.detach()
        with torch.set_grad_enabled(a.entropy_coeff != 0 and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if a.entropy_coeff else logits.detach(), self.temperature)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if a.entropy_coeff:
            loss = loss - a.entropy_coeff * aggregate_loss(entropy, mask, agg, self.max_len)
        if self.kl.in_loss:
            # Padding may hold anything (even NaN), which a KL's gradient would carry.
            ref = torch.where(mask.bool(), mb.ref_logp, logp.detach())
            kl = kl_penalty(logp, ref, self.kl.kind or "k3")
            loss = loss + kl_coef * aggregate_loss(kl, mask, agg, self.max_len)
            metrics["kl"] = masked_mean(kl.detach(), mask)
        if extra is not None:
            loss = loss + extra
            metrics.update(extra_metrics)
        weight = aggregation_weight(mask, agg)
        return loss * weight, weight, metrics

    def zero_advantage_loss(
        self, model: nn.Module, part: ZeroAdvantageRows
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """`loss` of rows with zero advantages, without the model: (0, w, metrics). On-policy
        the metrics are `policy_loss`'s own at ratio 1 (logp = old_logp, here both 0)."""
        pl, mask = self.loss_cfg, part.batch.response_mask.to(self.device)
        metrics: dict[str, Any] = {}
        if part.batch.old_logp is None:
            z = torch.zeros(mask.shape, device=self.device)
            _, metrics = policy_loss(z, z, z, mask, pl.clip_low, pl.clip_high, pl.dual_clip, pl.level,
                                     pl.loss_agg_mode, self.max_len)
        zero = torch.zeros((), device=self.device)
        if part.only_part:  # d(0 · Σθ)/dθ = 0 for every θ: AdamW steps as on the whole mini-batch
            zero = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
        metrics["policy_loss"] = zero.detach()
        return zero, aggregation_weight(mask, pl.loss_agg_mode), metrics

    def update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, kl_coef: float, seed: int) -> dict[str, float]:
        """`epochs` passes of shuffled mini-batches, one optimizer step each; then one
        scheduler step. Returns the metrics averaged over the optimizer steps.

        Needs the forward's fields and `advantages`; `old_logp` unless the update is one
        optimizer step (one epoch, one mini-batch: the loss then uses its own log-probs,
        detached); `ref_logp` with the KL in the loss; `values` and `returns` with a shared
        value head (`joint`)."""
        self.require_update_fields(batch, mini_batch_rows, epochs)
        return self.update_mini_batches(shuffled_mini_batches(batch, mini_batch_rows, epochs, seed), kl_coef)

    def update_mini_batches(self, minis: list[RLBatch], kl_coef: float) -> dict[str, float]:
        """One optimizer step per mini-batch, then one scheduler step; the metrics averaged
        over the steps. On a data-parallel worker each `minis[k]` is this worker's share of
        mini-batch k (every worker gets the same number, each at least one row)."""
        self.model.train()
        results: list[StepResult] = []
        for mini in minis:
            results.append(train_step(
                self.model, self.update_parts(mini), partial(self.loss, kl_coef=kl_coef),
                self.optimizer, None, self.cfg.trainer.max_grad_norm, self.cfg.trainer.precision, self.collective,
            ))
        self.scheduler.step()
        self.steps += 1
        return average_steps(results)

    def require_update_fields(self, batch: RLBatch, mini_batch_rows: int, epochs: int) -> None:
        """`update`'s fields (see there), checked before any forward pass."""
        role = "actor.update"
        batch.require(*FORWARD_FIELDS, "advantages", role=role)
        if epochs > 1 or mini_batch_rows < len(batch):
            batch.require("old_logp", role=role, why=f"off-policy: {epochs} epoch(s) of {mini_batch_rows}-row "
                          f"mini-batches over {len(batch)} rows, so later steps need the behaviour policy's")
        if self.kl.in_loss:
            batch.require("ref_logp", role=role, why="the KL term is in the loss")
        if self.joint is not None:
            batch.require("values", "returns", role=role, why="a shared value head trains with the actor")


def shuffled_mini_batches(batch: RLBatch, rows: int, epochs: int, seed: int) -> list[RLBatch]:
    """The mini-batches of an update, in order: epoch e shuffles the rows with seed + e and
    cuts them in mini-batches of `rows` rows (the driver of the Ray backend cuts them as
    the local actor does, then shares each out over the workers)."""
    out: list[RLBatch] = []
    for epoch in range(epochs):
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed + epoch))
        out += batch.select(order).split(rows)
    return out


def average_steps(results: list[StepResult], role: str = "actor") -> dict[str, float]:
    """Mean over optimizer steps of grad_norm, lr and every loss_fn metric (skipped steps'
    non-finite values left out), plus `<role>/optimizer_steps`, `<role>/skipped_steps`,
    `<role>/nonfinite_steps` and `<role>/overflow_steps` (the RL step reports those to the
    loop's bad-step guard)."""
    out: dict[str, list[float]] = {}
    for r in results:
        for key, value in {"grad_norm": r.grad_norm, "lr": r.lr, **r.metrics}.items():
            if value == value and abs(value) != float("inf"):
                out.setdefault(key, []).append(value)
    merged = {k: sum(v) / len(v) for k, v in out.items()}
    merged[f"{role}/skipped_steps"] = float(sum(r.skipped for r in results))
    merged[f"{role}/nonfinite_steps"] = float(sum(r.nonfinite for r in results))
    merged[f"{role}/overflow_steps"] = float(sum(r.overflow for r in results))
    merged[f"{role}/optimizer_steps"] = float(len(results))
    return merged
