"""The RL roles on Ray workers (trainer.backend=ray): veRL's hybrid engine.

Each worker process holds a `Colocated`: its own actor (policy, AdamW, schedule), its
reference and its rollout engine, all over one policy module, so the engine reads the
actor's weights in place and a weight sync copies nothing. The driver (`trainers/rl.py`,
unchanged) calls objects with the local roles' methods, which dispatch to the group
(`distributed.groups`; W workers):

    rollout.generate(prompts, seed)   RANK_ZERO   worker 0 samples the whole batch, so the
                                                  tokens are the local backend's, exactly
    actor.compute_logprobs(batch)     DP_COMPUTE  token-balanced parts, gathered to (B, Tr)
    ref.compute_logprobs(batch)       DP_COMPUTE
    actor.update(batch, rows, ...)    per rank    the driver shuffles and cuts mini-batches as
                                                  the local actor does (`shuffled_mini_batches`);
                                                  worker r gets a token-balanced share of each;
                                                  `train_step`'s collective all-reduces the
                                                  weight Σw, the gradients and the metrics, so
                                                  each optimizer step is the whole mini-batch's
    rollout.offload / sync_weights    ONE_TO_ALL  every engine takes its own actor's weights
    actor.model/optimizer/scheduler               the driver's mirror of worker 0's state
                                                  (all workers hold the same), fetched when read
                                                  after an update: checkpoints, final/, eval

Exactness (tests/trainers/test_rl_ray.py): 2 workers give the parameters of the local
backend after 3 GRPO steps in float64 within 1e-10: the global update is
    g = (1/W) Σ_r Σ_{k∈r} ∇(w_k L_k) · W / Σ_k w_k = Σ_k ∇(w_k L_k) / Σ_k w_k,
the local one whatever the shares (`distributed.collectives`).

A restored checkpoint reaches the workers when the driver sets `actor.steps` (what
`RLTrainer.restore` does after loading the mirror): the mirror's weights, optimizer and
schedule are pushed to every worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.config.rl import RLConfig
from posttrain.distributed.dispatch import shard_rows
from posttrain.distributed.groups import GroupSpec, RayWorkerGroup
from posttrain.models.lora import is_peft
from posttrain.rollout import MultiTurnLimits, SamplingParams
from posttrain.trainers.rl_build import build_reference, build_rollout
from posttrain.workers import Actor, RLBatch
from posttrain.workers.actor import shuffled_mini_batches
from posttrain.workers.forward import FORWARD_FIELDS


class Colocated:
    """A worker's roles: actor + reference + rollout over one policy (built in the worker's
    process by `RayWorkerGroup`; `policy` arrives as the driver's initial weights)."""

    def __init__(self, rank: int, world_size: int, collective: Any, cfg: RLConfig, tokenizer: Any,
                 policy: torch.nn.Module):
        self.rank = rank
        self.ref = build_reference(cfg, policy)  # before training: a copy of the initial policy
        self.actor = Actor(policy, cfg, cfg.trainer.max_steps - cfg.critic.warmup_steps, collective=collective)
        self.rollout = build_rollout(cfg, policy, tokenizer)

    def generate(self, prompts: RLBatch, seed: int, params: SamplingParams | None) -> RLBatch:
        return self.rollout.generate(prompts, seed, params)

    def actor_logprobs(self, batch: RLBatch) -> torch.Tensor:
        return self.actor.compute_logprobs(batch)

    def ref_logprobs(self, batch: RLBatch) -> torch.Tensor:
        return self.ref.compute_logprobs(batch)

    def update(self, shares: list[RLBatch], kl_coef: float) -> dict[str, float]:
        return self.actor.update_mini_batches(shares, kl_coef)

    def offload(self) -> None:
        self.rollout.offload()

    def sync_weights(self) -> None:
        self.rollout.sync_weights(self.actor.model)

    def lr(self) -> float:
        return self.actor.lr

    def steps(self) -> int:
        return self.actor.steps

    def state(self, part: str) -> dict[str, Any]:
        """`model`: the policy's weights; `optimizer`: AdamW's and the schedule's state."""
        a = self.actor
        if part == "model":
            return {k: v.detach().cpu().clone() for k, v in a.model.state_dict().items()}
        return {"optimizer": a.optimizer.state_dict(), "scheduler": a.scheduler.state_dict(), "steps": a.steps}

    def load_state(self, state: dict[str, Any]) -> None:
        a = self.actor
        a.model.load_state_dict(state["model"])
        a.optimizer.load_state_dict(state["optimizer"])
        a.scheduler.load_state_dict(state["scheduler"])
        a.steps = state["steps"]
        self.rollout.sync_weights(a.model)


class RayActor:
    """The actor role over the group (module doc); `mirror` is a driver-side Actor over the
    initial policy, whose model, optimizer and scheduler take worker 0's state when read."""

    def __init__(self, group: Any, mirror: Actor):
        self.group, self.mirror = group, mirror
        self._stale: set[str] = set()

    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr), as `Actor.compute_logprobs`, computed over the workers."""
        batch.require(*FORWARD_FIELDS, role="actor.compute_logprobs")
        return self.group.dp_compute("actor_logprobs", batch)

    def update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, kl_coef: float, seed: int) -> dict[str, float]:
        """`Actor.update` over the workers: the same mini-batches, each shared out by tokens."""
        self.mirror.require_update_fields(batch, mini_batch_rows, epochs)
        w = self.group.world_size
        shares = [shard_rows(mini, w, pad=False).parts for mini in shuffled_mini_batches(batch, mini_batch_rows, epochs, seed)]
        results = self.group.per_rank("update", [([s[r] for s in shares], kl_coef) for r in range(w)])
        self._stale = {"model", "optimizer"}
        return results[0]  # reduced over the workers inside each step: the same on every worker

    def _fetch(self, part: str) -> None:
        if part not in self._stale:
            return
        state = self.group.rank_zero("state", part)
        m = self.mirror
        if part == "model":
            m.model.load_state_dict(state)
        else:
            m.optimizer.load_state_dict(state["optimizer"])
            m.scheduler.load_state_dict(state["scheduler"])
            m.steps = state["steps"]
        self._stale.discard(part)

    @property
    def model(self) -> torch.nn.Module:
        self._fetch("model")
        return self.mirror.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        self._fetch("optimizer")
        return self.mirror.optimizer

    @property
    def scheduler(self) -> Any:
        self._fetch("optimizer")
        return self.mirror.scheduler

    @property
    def lr(self) -> float:
        return float(self.group.rank_zero("lr"))

    @property
    def steps(self) -> int:
        return int(self.group.rank_zero("steps"))

    @steps.setter
    def steps(self, value: int) -> None:
        """After a restore: the mirror's state (just loaded) goes to every worker."""
        m = self.mirror
        self.group.one_to_all("load_state", {
            "model": {k: v.detach().cpu() for k, v in m.model.state_dict().items()},
            "optimizer": m.optimizer.state_dict(), "scheduler": m.scheduler.state_dict(), "steps": value,
        })
        m.steps, self._stale = value, set()


@dataclass(frozen=True)
class EngineInfo:
    kind: str
    """The engine every worker runs (native, hf)."""


class RayRollout:
    """The rollout role over the group: generation on worker 0, sync on every worker.
    Single-turn only (`env_factory` None: build_roles refuses episodes on Ray)."""

    def __init__(self, group: Any, params: SamplingParams, kind: str):
        self.group, self.params, self.engine = group, params, EngineInfo(kind)
        self.env_factory, self.limits = None, MultiTurnLimits()

    def generate(self, prompts: RLBatch, seed: int, params: SamplingParams | None = None) -> RLBatch:
        prompts.require("prompt_ids", "prompt_mask", "prompts", role="rollout.generate")
        return self.group.rank_zero("generate", prompts, seed, params)

    def offload(self) -> None:
        self.group.one_to_all("offload")

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Each worker's engine takes its own actor's weights, in place (`model`, the
        driver's mirror, is not sent: the workers hold the same weights)."""
        self.group.one_to_all("sync_weights")


class RayReference:
    """π_ref over the group (each worker holds its copy, or its adapter-disabled policy)."""

    synced = False  # algorithm.ref_sync_steps is refused on this backend (config check)

    def __init__(self, group: Any, shares_policy: bool):
        self.group, self.shares_policy = group, shares_policy

    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        batch.require(*FORWARD_FIELDS, role="ref.compute_logprobs")
        return self.group.dp_compute("ref_logprobs", batch)

    def saved_model(self) -> None:
        """Nothing to save: the reference stays the initial policy."""
        return None


def build_ray_roles(cfg: RLConfig, tokenizer: Any, policy: torch.nn.Module,
                    group: Any = None) -> tuple[RayActor, RayRollout, RayReference | None, Any]:
    """Start the workers (each builds `Colocated` from `policy`'s initial weights) and the
    driver-side roles over them; `group` replaces the Ray group (a `LocalWorkerGroup`)."""
    from posttrain.rollout import engine_kind_for

    t = cfg.trainer
    if group is None:
        spec = GroupSpec(t.nnodes, t.n_workers_per_node, cfg.placement.cpus_per_worker, cfg.ray.address,
                         t.collective_timeout_s)
        group = RayWorkerGroup(spec, Colocated, cfg, tokenizer, policy)
    mirror = Actor(policy, cfg, t.max_steps - cfg.critic.warmup_steps)
    ref = RayReference(group, is_peft(policy)) if cfg.algorithm.kl.enabled else None
    kind = engine_kind_for(policy) if cfg.rollout.engine == "auto" else cfg.rollout.engine
    return RayActor(group, mirror), RayRollout(group, SamplingParams.from_config(cfg.rollout), kind), ref, group
