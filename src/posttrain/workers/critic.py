"""The critic role (PPO): values V(s_t) of every response position, and their regression.

Notation: B rows, Tr response tokens, H hidden size. s_t = prompt + response[:t], read at
the same column as the logits that predict response token t (workers/forward.py).
Loss (`posttrain.algos.value_loss`, PPO2 / veRL / TRL):
    ℓ_t = ½ max((V_t − R_t)², (clip(V_t, V_old,t ± value_clip) − R_t)²),
aggregated with the actor's `loss_agg_mode` and scaled by `vf_coef`.

Two layouts (`critic.share_backbone`):
- separate (default, veRL): its own `ScalarHeadModel` (initialised from `critic.model_path`,
  else from the policy's initial weights with a zero head, so every value starts at 0),
  its own AdamW and schedule; `update` runs after the values are used for GAE and before
  the actor's update, over the same mini-batch layout (ppo_epochs × shuffled mini-batches,
  one optimizer step each, exact accumulation over micro-batches). On a data-parallel
  worker (the Ray backend, `collective` given) `update_mini_batches` takes this worker's
  share of each mini-batch, and each step all-reduces its weight, gradients and metrics
  (`training.core.train_step`), as the actor's.
- shared (TRL's old value-head models): a zero-initialised head on the policy's own
  backbone. One forward gives logits and values; the value loss joins the actor's loss,
  L = L_policy + vf_coef · L_value, under the actor's optimizer. `update` then does
  nothing: the actor's update trains both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from posttrain.algos import aggregation_weight, masked_mean, value_loss
from posttrain.config.rl import RLConfig
from posttrain.models.heads import ScalarHeadModel
from posttrain.models.loading import enable_gradient_checkpointing, is_sharded
from posttrain.training.core import (
    StepCollective,
    autocast,
    build_optimizer,
    build_scheduler,
    train_step,
)
from posttrain.workers.actor import average_steps, shuffled_mini_batches
from posttrain.workers.batch import RLBatch
from posttrain.workers.forward import (
    FORWARD_FIELDS,
    builtin_of,
    check_packing_support,
    device_of,
    micro_batches,
    per_token_pass,
    response_states,
)


def response_values(model: ScalarHeadModel, batch: RLBatch, remove_padding: bool = False) -> torch.Tensor:
    """V(s_0) … V(s_{Tr−1}), float32 (float64 from a float64 model) (B, Tr), zero at padding when packed."""
    (values,) = response_states(model.hidden_states, batch, lambda h: (at_least_float32(model.score(h).squeeze(-1)),),
                                remove_padding, one_row=model.is_builtin)
    return values


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def head_on_policy(policy: nn.Module) -> ScalarHeadModel:
    """A zero-initialised value head on `policy`'s own backbone (no copy)."""
    builtin = builtin_of(policy)
    if builtin is not None:
        return ScalarHeadModel(builtin.model, builtin.config, "model", init_std=0.0)
    return ScalarHeadModel(policy.base_model, policy.config, policy.base_model_prefix, init_std=0.0)


class Critic:
    """V_φ (veRL's critic worker; TRL's `value_model`).

    Args:
        model: the value model (`ScalarHeadModel`); for a shared critic, `head_on_policy(policy)`.
        cfg: the run's config: `critic.*` (value clip, vf_coef, learning rate, micro-batches),
            the actor's `loss_agg_mode` and token budget per micro-batch, `trainer.*`.
        total_steps: RL steps the schedule spans.
        policy: the policy whose backbone `model` shares, or None for a separate critic.
        collective: the data-parallel group of a Ray worker (None: one process).
    """

    def __init__(self, model: ScalarHeadModel, cfg: RLConfig, total_steps: int, policy: nn.Module | None = None,
                 collective: StepCollective | None = None):
        self.model, self.cfg, self.policy = model, cfg, policy
        self.collective = collective
        self.c, self.agg = cfg.critic, cfg.actor.policy_loss.loss_agg_mode
        self.micro_batch_size = cfg.critic.micro_batch_size or cfg.actor.micro_batch_size
        self.max_tokens = cfg.actor.max_tokens_per_micro_batch
        self.shared = policy is not None
        self.remove_padding = cfg.model.use_remove_padding
        if self.remove_padding and not model.is_builtin:
            check_packing_support(model.backbone)
        if cfg.model.gradient_checkpointing and not self.shared:  # a shared backbone: the actor's
            enable_gradient_checkpointing(model)
        self.optimizer = self.scheduler = None
        if not self.shared:
            trainer = dataclasses.replace(cfg.trainer, learning_rate=self.c.learning_rate or cfg.trainer.learning_rate)
            self.optimizer = build_optimizer(model, trainer)
            self.scheduler = build_scheduler(self.optimizer, trainer, total_steps)
        self.steps = 0

    @property
    def device(self) -> torch.device:
        return device_of(self.model)

    def compute_values(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr) V(s_t), 0 on padding (CPU). Needs the forward's fields (`FORWARD_FIELDS`)."""
        batch.require(*FORWARD_FIELDS, role="critic.compute_values")

        def values(mb: RLBatch) -> torch.Tensor:
            return response_values(self.model, mb, self.remove_padding)

        with autocast(self.cfg.trainer.precision, self.device):
            (out,) = per_token_pass(batch, values, self.micro_batch_size, self.max_tokens, self.device,
                                    packed=self.remove_padding,
                                    collective=self.collective if is_sharded(self.model) else None)
        return out

    def _value_term(self, values: torch.Tensor, mb: RLBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = mb.response_mask
        loss, metrics = value_loss(values, mb.values, mb.returns, mask, self.c.value_clip, self.agg)
        metrics["value_loss"] = loss.detach()
        metrics["values/mean"] = masked_mean(values.detach(), mask)
        return self.c.vf_coef * loss, metrics

    def loss(self, model: ScalarHeadModel, mb: RLBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The `train_step` contract for a separate critic."""
        values = response_values(model, mb, self.remove_padding)
        term, metrics = self._value_term(values, mb)
        weight = aggregation_weight(mb.response_mask, self.agg)
        return term * weight, weight, metrics

    def joint_forward(self, policy: nn.Module, mb: RLBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Shared backbone: one forward → (logits (b, tr, V), vf_coef · value loss, metrics)."""
        head = policy.get_output_embeddings()
        logits, values = response_states(self.model.hidden_states, mb,
                                         lambda h: (head(h), at_least_float32(self.model.score(h).squeeze(-1))),
                                         self.remove_padding, one_row=self.model.is_builtin)
        term, metrics = self._value_term(values, mb)
        return logits, term, metrics

    def update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, seed: int) -> dict[str, float]:
        """ppo_epochs × shuffled mini-batches, one critic optimizer step each (separate
        critic); nothing for a shared one (the actor's update trains it). Needs the
        forward's fields, `values` (V_old, the clip's centre) and `returns` (the targets)."""
        if self.shared:
            return {}
        batch.require(*FORWARD_FIELDS, "values", "returns", role="critic.update")
        return self.update_mini_batches(shuffled_mini_batches(batch, mini_batch_rows, epochs, seed))

    def update_mini_batches(self, minis: list[RLBatch]) -> dict[str, float]:
        """One critic optimizer step per mini-batch, then one scheduler step; the metrics
        averaged over the steps. On a data-parallel worker each `minis[k]` is this worker's
        share of mini-batch k (every worker gets the same number, each at least one row)."""
        self.model.train()
        results = [
            train_step(self.model, micro_batches(mini, self.micro_batch_size, self.max_tokens, self.device,
                                                 packed=self.remove_padding),
                       self.loss, self.optimizer, None, self.cfg.trainer.max_grad_norm, self.cfg.trainer.precision,
                       self.collective)
            for mini in minis
        ]
        self.scheduler.step()
        self.steps += 1
        return average_steps(results, role="critic")


def shared_value_params(critic: Critic) -> nn.Module:
    """The parameters a shared critic adds to the actor's optimizer: its head."""
    return critic.model.score

