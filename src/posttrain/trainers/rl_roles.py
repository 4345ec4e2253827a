"""The roles the RL driver calls: views over the run's worker groups, the same on every backend.

trainer.backend=local: one `RLWorker` in this process (`LocalWorkerGroup`, no Ray);
trainer.backend=ray: N per pool (`rl_ray.start_worker_pools`). The views are generated from the
worker's declarations (`distributed.register.role_view`), so the driver (`trainers/rl.py`)
calls `roles.actor.compute_logprobs(batch)` whatever runs it. The reward stays in the driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.rl import RLConfig
from posttrain.distributed.groups import LocalWorkerGroup, WorkerDied
from posttrain.distributed.pools import WorkerPools
from posttrain.distributed.register import RoleView, role_view
from posttrain.logging import get_logger
from posttrain.rollout import MultiTurnLimits
from posttrain.trainers.rl_build import initial_models, sampling_params
from posttrain.trainers.rl_worker import RLWorker, pool_factories
from posttrain.workers import Reward
from posttrain.workers.roles import ActorRole, CriticRole, ReferenceRole, RolloutRole

log = get_logger(__name__)


@dataclass
class Roles:
    """What the driver calls (see `posttrain.workers.roles`) and the worker groups under it."""

    actor: ActorRole
    rollout: RolloutRole
    reward: Reward
    ref: ReferenceRole | None
    critic: CriticRole | None
    pools: WorkerPools
    """The worker groups by pool name (one in-process worker locally), closed at the end."""
    workers: list[RoleView]
    """Each pool's worker-level calls (checkpoint shards, restore)."""
    own_rollout_pool: bool = False
    """placement.rollout: the engines run over policy copies of their own."""

    def offload_rollout(self) -> None:
        """Before the update: colocated engines give their memory to it (a pool of its own
        has nothing to give: the update runs elsewhere)."""
        if not self.own_rollout_pool:
            self.rollout.offload()

    def sync_rollout(self) -> None:
        """After an update: each colocated engine takes its own actor's weights in place; a
        rollout pool of its own loads actor worker 0's (one state dict, never through the
        driver on Ray)."""
        if self.own_rollout_pool:
            self.rollout.load_weights(self.actor.policy_weights())
        else:
            self.rollout.sync_weights()

    @property
    def in_process(self) -> bool:
        """Every worker is an object of this process (trainer.backend=local, or tests' groups):
        its modules are readable here without a copy."""
        return all(isinstance(g, LocalWorkerGroup) for g in self.pools.groups.values())

    def save_hf(self, folder: Path, final: bool = False) -> None:
        """The HF folders of a checkpoint (or of `final/`) into `folder`, written by each pool's
        worker 0 from its own modules (`RLWorker.save_hf`): the driver holds no weights."""
        for w in self.workers:
            w.save_hf(str(folder), final)

    def save_shards(self, folder: Path) -> None:
        """Every worker of every pool writes its roles' shards into the unsealed `folder`."""
        for w in self.workers:
            w.save_shards(str(folder))

    def restore(self, checkpoint: Path, step: int) -> None:
        """Every worker loads the checkpoint (any worker count wrote it); a rollout pool of
        its own then takes the actor's weights."""
        for w in self.workers:
            w.restore(str(checkpoint), step)
        if self.own_rollout_pool:
            self.sync_rollout()

    def close(self) -> None:
        """Stop the engines' outside resources (`RLWorker.close_engine`), the workers (and a Ray
        this run started) and the reward worker processes (reward.isolation=process)."""
        self.reward.runner.close()
        if self.pools.groups:  # not yet closed
            try:
                self.rollout.close()
            except WorkerDied:
                pass  # the death the run stopped on, which its WorkerFailure names: said once, not twice
            except Exception as e:
                log.warning("closing the rollout engines failed (%s: %s); stopping the workers", type(e).__name__, e)
        self.pools.close()


def build_roles(cfg: RLConfig, tokenizer: Any, model: Any, reward_funcs: Any, value_model: Any,
                columns: Sequence[str] | None = None, data: str = "the data", env_factory: Any = None,
                make_group: Any = None) -> Roles:
    """Checks and initial models first (`rl_build.initial_models`), then the worker groups of
    every pool, each worker building its roles from those models (`RLWorker`), then the
    views. `make_group(RLWorker, *args)` replaces a pool's group (tests: W workers in process)."""
    on_ray = make_group is None and cfg.trainer.backend == "ray"  # the workers build their own models
    policy, value, reward = initial_models(cfg, tokenizer, model, reward_funcs, value_model, columns, data,
                                           env_factory, build=not on_ray)
    specs, mapping = cfg.resource_pools()
    args = pool_factories(cfg, tokenizer, policy, value, env_factory, mapping)
    if make_group is not None:
        pools = WorkerPools({name: make_group(RLWorker, *a) for name, a in args.items()})
    elif cfg.trainer.backend == "ray":
        from posttrain.trainers.rl_ray import start_worker_pools

        pools = start_worker_pools(cfg, specs, mapping, args)
    else:
        pools = WorkerPools({name: LocalWorkerGroup(RLWorker, *a) for name, a in args.items()})
    return views(cfg, pools, mapping, reward, env_factory)


def views(cfg: RLConfig, pools: WorkerPools, mapping: dict[str, str], reward: Reward, env_factory: Any) -> Roles:
    """The driver's roles over `pools` (`mapping`: role → pool name); what the policy is
    (engine kind, LoRA) comes from actor worker 0 (`RLWorker.describe`)."""
    rc = cfg.rollout
    actor_group = pools[mapping["actor"]]
    facts = role_view(actor_group, RLWorker, "actor").describe()
    kind = facts["kind"] if rc.engine == "auto" else rc.engine
    rollout = role_view(pools[mapping["rollout"]], RLWorker, "rollout", {"split": rc.split}, kind=kind,
                        params=sampling_params(cfg), env_factory=env_factory,
                        limits=MultiTurnLimits.from_config(rc.multi_turn))
    ref = role_view(actor_group, RLWorker, "ref", shares_policy=facts["peft"]) if cfg.algorithm.kl.enabled else None
    critic = role_view(pools[mapping["critic"]], RLWorker, "critic") if cfg.use_critic else None
    workers = [role_view(pools[name], RLWorker) for name in dict.fromkeys(mapping.values())]
    return Roles(role_view(actor_group, RLWorker, "actor"), rollout, reward, ref, critic, pools, workers,
                 own_rollout_pool=mapping["rollout"] != mapping["actor"])
