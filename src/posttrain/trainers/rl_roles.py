"""The roles the RL driver calls: views over the run's worker groups, the same on every backend.

trainer.backend=local: one `RLWorker` in this process (`LocalWorkerGroup`, no Ray);
trainer.backend=ray: N per pool (`rl_ray.start_worker_pools`). The views are generated from the
worker's declarations (`distributed.register.role_view`), so the driver (`trainers/rl.py`)
calls `roles.actor.compute_logprobs(batch)` whatever runs it. The reward stays in the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from posttrain.config.rl import RLConfig
from posttrain.distributed.groups import LocalWorkerGroup, WorkerDied, collective_backend
from posttrain.distributed.pools import WorkerPools
from posttrain.distributed.register import RoleView, role_view
from posttrain.logging import get_logger
from posttrain.rollout import MultiTurnLimits
from posttrain.trainers.rl_build import initial_models, sampling_params
from posttrain.trainers.rl_worker import RLWorker, pool_factories
from posttrain.workers import Reward
from posttrain.workers.roles import ActorRole, CriticRole, ReferenceRole, RolloutRole

log = get_logger(__name__)


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run `calls` at once, one thread each (the two sides of a weight group's broadcasts are
    calls on two worker groups), and wait for all; the first error is raised."""
    with ThreadPoolExecutor(len(calls), thread_name_prefix="weight-sync") as pool:
        futures = [pool.submit(c) for c in calls]
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


@dataclass
class PoolSync:
    """The actor's weights to a rollout pool of its own (placement.rollout.enable_resource_pool):
    actor worker 0 and the R rollout workers join a weight group of their own (ranks 0 and
    1..R; gloo, NCCL between whole GPUs), joined at the first sync; each sync streams the
    weights over it in buckets of rollout.sync_bucket_mb (`rollout/weight_stream.py`): the
    actor side's `send_weights` and the rollout side's `receive_weights` run at once. Under
    trainer.strategy=fsdp2 every actor worker gathers one parameter at a time for worker 0's
    buckets: no process holds the whole model beyond the rollout engine's own copy."""

    actor: Any
    rollout: Any
    workers: list[RoleView]
    rollout_world: int
    bucket_bytes: int
    backend: str
    timeout_s: float
    joined: bool = False
    staged: int = 0

    def sync(self, send: Callable[[], None] | None = None) -> None:
        """Stream the weights (`send`: the actor side's call; default: its current weights). A
        failure leaves the group on the sides that saw it; the next sync joins a new one."""
        if not self.joined:
            self.join()
        try:
            together(send or self.actor.send_weights, self.rollout.receive_weights)
        except BaseException:
            self.joined = False
            raise

    def staged_sync(self) -> Callable[[], None]:
        """Async RL: actor worker 0 keeps the current weights now (every worker gathers);
        the returned call streams that copy later, while the actor trains on."""
        self.staged += 1
        self.actor.stage_weights(self.staged)
        return partial(self.sync, partial(self.actor.send_staged, self.staged))

    def join(self) -> None:
        host = self.actor.host_weights(self.bucket_bytes)
        world = 1 + self.rollout_world
        together(partial(self.actor.join_weights, world, self.backend, self.timeout_s),
                 partial(self.rollout.join_weights, host["addr"], host["port"], world, self.backend, self.timeout_s,
                         host["plan"]))
        self.joined = True

    def leave(self) -> None:
        """Every worker leaves its weight group (at the end, or when its workers restarted)."""
        self.joined = False
        for w in self.workers:
            w.leave_weights()


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
    pool_sync: PoolSync | None = None
    """placement.rollout: the engines run over policy copies of their own, synced over it."""

    @property
    def own_rollout_pool(self) -> bool:
        return self.pool_sync is not None

    def offload_rollout(self) -> None:
        """Before the update: colocated engines give their memory to it (a pool of its own
        has nothing to give: the update runs elsewhere)."""
        if not self.own_rollout_pool:
            self.rollout.offload()

    def sync_rollout(self) -> None:
        """After an update: each colocated engine takes its own actor's weights in place; a
        rollout pool of its own has them streamed from actor worker 0 (`PoolSync`)."""
        if self.pool_sync is not None:
            self.pool_sync.sync()
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
        if self.pool_sync is not None:
            self.sync_rollout()

    def close(self) -> None:
        """Stop the engines' outside resources (`RLWorker.close_engine`), the workers (and a Ray
        this run started) and the reward worker processes (reward.isolation=process)."""
        self.reward.runner.close()
        if self.pools.groups:  # not yet closed
            try:
                if self.pool_sync is not None:
                    self.pool_sync.leave()
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
    own_pool = mapping["rollout"] != mapping["actor"]
    # fsdp2 with the engines elsewhere: eval.task gathers the policy on every actor worker
    actor = role_view(actor_group, RLWorker, "actor", {"gathered_eval": own_pool and cfg.trainer.strategy == "fsdp2"})
    sync = None
    if own_pool:
        cuda = facts["device"].startswith("cuda")
        sync = PoolSync(actor, rollout, workers, pools[mapping["rollout"]].world_size, int(rc.sync_bucket_mb * 2**20),
                        collective_backend(cfg.placement.gpus_per_worker, cuda), cfg.trainer.collective_timeout_s)
    return Roles(actor, rollout, reward, ref, critic, pools, workers, pool_sync=sync)
