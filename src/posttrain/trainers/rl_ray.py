"""The RL roles on Ray workers (trainer.backend=ray): veRL's hybrid engine and resource pools.

By default each worker process holds a `Colocated`: its own actor (policy, AdamW, schedule),
its reference, its critic (PPO: a separate value model with its own AdamW) and its rollout
engine, the engine over the actor's policy module, so it reads the actor's weights in place
and a weight sync copies nothing. `RLConfig.resource_pools` may map the critic or the
rollout to a pool of its own (placement.critic / placement.rollout): that pool's workers
hold only that role (a critic pool: its own gloo group; a rollout pool: engines over their
own policy copy, which `rollout.sync_from` fills from the actor's worker 0, once through
Ray's object store, after each update). The reference stays with the actor. The driver (`trainers/rl.py`, unchanged) calls objects
with the local roles' methods, which dispatch to the group (`distributed.groups`; W workers):

    rollout.generate(prompts, seed)   RANK_ZERO   worker 0 samples the whole batch (or plays
                                                  every episode, rollout.env), so the tokens
                                                  are the local backend's, exactly
                                      DP_SPLIT    rollout.seed_mode=row (rollout.dispatch):
                                                  worker r samples a contiguous slice of the
                                                  prompts, each row drawing by its index in
                                                  the batch, so the tokens are the local
                                                  backend's (same seed_mode); the slices are
                                                  concatenated in order, uids given here
    actor.compute_logprobs(batch)     DP_COMPUTE  token-balanced parts, gathered to (B, Tr)
    ref.compute_logprobs(batch)       DP_COMPUTE
    critic.compute_values(batch)      DP_COMPUTE
    critic.update(batch, rows, ...)   per rank    the driver shuffles and cuts mini-batches as
    actor.update(batch, rows, ...)    per rank    the local roles do (`shuffled_mini_batches`);
                                                  worker r gets a token-balanced share of each;
                                                  `train_step`'s collective all-reduces the
                                                  weight Σw, the gradients and the metrics, so
                                                  each optimizer step is the whole mini-batch's
    ref.sync(policy, alpha)           ONE_TO_ALL  every reference moves towards its own actor
    rollout.offload / sync_from       ONE_TO_ALL  every engine takes its own actor's weights (a
                                                  rollout pool: actor worker 0's, `load_weights`)
    actor/critic .model, ref.model                the driver's mirror of worker 0's weights (all
                                                  workers hold the same), fetched when read
                                                  after an update or a sync: the checkpoints'
                                                  HF folders, final/, eval
    save_shards / load_shards (checkpoint)        ONE_TO_ALL  every worker of each pool writes /
                                                  reads its roles' DCP shards (model + AdamW;
                                                  resharded on load: any worker count)

Exactness (tests/trainers/test_rl_ray.py): 2 workers give the parameters of the local
backend (actor and critic) after 3 steps in float64 within 1e-10: the global update is
    g = (1/W) Σ_r Σ_{k∈r} ∇(w_k L_k) · W / Σ_k w_k = Σ_k ∇(w_k L_k) / Σ_k w_k,
the local one whatever the shares (`distributed.collectives`).

Checkpoints (`RLTrainer.save` / `restore`, docs/distributed.md "Checkpoints"): the workers
write each role's model and optimizer as DCP shards into the unsealed folder
(`write_shards`), and read them back, resharded, on resume (`load_shards`); the driver's
optimizer mirror is never fetched for them. A checkpoint of the one-process layout (no
`dcp/`) still resumes through the mirrors: setting `actor.steps`, `critic.steps`
(`RunModels.load_critic`) and `ref.synced` (`RunModels.load_reference`) pushes the mirror's
weights (and optimizer, schedule) to every worker.

The vllm engine (rollout.engine=vllm; GPU workers, placement.gpus_per_worker, with vLLM's CUDA
build, CPU workers with its CPU build): each worker
builds its own `VLLMEngine` over its actor's policy, last (`build_rollout`, after the actor,
reference and critic took their memory), and runs it in the worker's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0). `rollout.offload` puts every engine to sleep (level 1,
where sleep mode exists) before the update; `rollout.sync_from` wakes each and loads its own
actor's new weights in place (`VLLMEngine.sync_weights`: `collective_rpc`, tensors by
reference in process), then drops its prefix cache: the local engine's path, per worker.

A worker that dies stops the run within seconds (`WorkerFailure`, naming it and the last
complete checkpoint), or with trainer.on_worker_failure=restart starts new workers and
resumes from that checkpoint (`rl_faults.run_restarting`, around the loop; the driver is unchanged).

Not on this backend: a critic on the policy's backbone (critic.share_backbone: the value
head and the policy would train in one loss and one optimizer, a layout the workers' separate
roles do not have; config checks, `RLConfig._validate_ray`). An
environment or tool loaded from a file (`file.py:Class`) reaches the workers by value
(`rewards.registry.pickle_file_modules_by_value`); one given in Python must be importable by
the workers, or defined in the driver's script (cloudpickle sends `__main__`'s by value).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.config.rl import RLConfig
from posttrain.distributed.checkpoint import SHARDS, load_sharded, save_sharded
from posttrain.distributed.dispatch import shard_rows
from posttrain.distributed.groups import GroupSpec
from posttrain.logging import get_logger
from posttrain.models.heads import ScalarHeadModel
from posttrain.models.lora import is_peft
from posttrain.rollout import MultiTurnLimits, SamplingParams
from posttrain.trainers.rl_build import Roles, build_reference, build_rollout, sampling_params
from posttrain.workers import Actor, Critic, Reward, RLBatch
from posttrain.workers.actor import shuffled_mini_batches
from posttrain.workers.forward import FORWARD_FIELDS

log = get_logger(__name__)
ALL_ROLES = ("actor", "rollout", "critic")
ROLE_STATE = "role_state.pt"
"""Next to a trained role's DCP shards: {"scheduler": its state_dict, "steps": n}."""


class Colocated:
    """A worker's roles, those of its pool (`roles`; all of them colocated by default):
    actor + reference, critic, rollout (built in the worker's process by `RayWorkerGroup`;
    `policy` and `value_model` arrive as the driver's initial weights, None where the pool
    does not hold their role, `env_factory` as the episodes' environment factory, None for
    single-turn rollouts). The rollout's engine runs over the actor's policy when both are
    here, else over this worker's own copy of it (`load_weights`)."""

    def __init__(self, rank: int, world_size: int, collective: Any, cfg: RLConfig, tokenizer: Any,
                 policy: torch.nn.Module | None, value_model: ScalarHeadModel | None = None, env_factory: Any = None,
                 roles: tuple[str, ...] = ALL_ROLES):
        self.rank, self.policy = rank, policy
        self.ref = self.actor = self.critic = self.rollout = None
        if "actor" in roles:
            self.ref = build_reference(cfg, policy)  # before training: a copy of the initial policy
            self.actor = Actor(policy, cfg, cfg.trainer.max_steps - cfg.critic.warmup_steps, collective=collective,
                               episodes=env_factory is not None)
        if "critic" in roles and value_model is not None:
            self.critic = Critic(value_model, cfg, cfg.trainer.max_steps, collective=collective)
        if "rollout" in roles:
            self.rollout = build_rollout(cfg, policy, tokenizer, env_factory)

    def generate(self, prompts: RLBatch, seed: int, params: SamplingParams | None) -> RLBatch:
        return self.rollout.generate(prompts, seed, params)

    def generate_slice(self, prompts: RLBatch | None, first: int, seed: int,
                       params: SamplingParams | None) -> RLBatch | None:
        """Responses to a slice of a batch whose first prompt is the batch's `first` (None: no
        prompts for this worker)."""
        return None if prompts is None else self.rollout.generate(prompts, seed, params, first)

    def actor_logprobs(self, batch: RLBatch) -> torch.Tensor:
        return self.actor.compute_logprobs(batch)

    def ref_logprobs(self, batch: RLBatch) -> torch.Tensor:
        return self.ref.compute_logprobs(batch)

    def critic_values(self, batch: RLBatch) -> torch.Tensor:
        return self.critic.compute_values(batch)

    def update(self, shares: list[RLBatch], kl_coef: float) -> dict[str, float]:
        return self.actor.update_mini_batches(shares, kl_coef)

    def critic_update(self, shares: list[RLBatch]) -> dict[str, float]:
        return self.critic.update_mini_batches(shares)

    def ref_sync(self, alpha: float) -> None:
        self.ref.sync(self.actor.model, alpha)

    def offload(self) -> None:
        self.rollout.offload()

    def sync_weights(self) -> None:
        self.rollout.sync_weights(self.actor.model)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The actor's weights, on the CPU, for a rollout pool (`RayRollout.sync_from`)."""
        return {k: v.detach().cpu() for k, v in self.actor.model.state_dict().items()}

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A rollout pool's worker: its policy copy takes the actor's weights, its engine samples from them."""
        self.policy.load_state_dict(state)
        self.rollout.sync_weights(self.policy)

    def lr(self) -> float:
        return self.actor.lr

    def steps(self, role: str) -> int:
        return self._trained(role).steps

    def _trained(self, role: str) -> Actor | Critic:
        return self.actor if role == "actor" else self.critic

    def state(self, role: str, part: str) -> dict[str, Any]:
        """`model`: the weights of role `actor`, `critic` or `ref`; `optimizer`: AdamW's and
        the schedule's state of `actor` or `critic`."""
        if part == "model":
            model = self.ref.model if role == "ref" else self._trained(role).model
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        r = self._trained(role)
        return {"optimizer": r.optimizer.state_dict(), "scheduler": r.scheduler.state_dict(), "steps": r.steps}

    def load_state(self, role: str, state: dict[str, Any]) -> None:
        """A restored state: the reference's weights (`ref`: {"model"}), or a trained role's
        weights, optimizer, schedule and step count."""
        if role == "ref":
            self.ref.model.load_state_dict(state["model"])
            self.ref.synced = True
            return
        r = self._trained(role)
        r.model.load_state_dict(state["model"])
        r.optimizer.load_state_dict(state["optimizer"])
        r.scheduler.load_state_dict(state["scheduler"])
        r.steps = state["steps"]
        if role == "actor" and self.rollout is not None:
            self.rollout.sync_weights(r.model)

    def save_shards(self, checkpoint: str, roles: list[str]) -> None:
        """Write each role's state into `checkpoint`/dcp/<role>/ (collective: every worker
        calls it): the weights and AdamW's state as DCP shards (`ref`: the weights), and, from
        worker 0, the schedule and step count (`ROLE_STATE`, the same on every worker)."""
        for role in roles:
            folder = Path(checkpoint) / SHARDS / role
            if role == "ref":
                save_sharded(folder, self.ref.model)
                continue
            r = self._trained(role)
            save_sharded(folder, r.model, r.optimizer)
            if self.rank == 0:
                torch.save({"scheduler": r.scheduler.state_dict(), "steps": r.steps}, folder / ROLE_STATE)

    def load_shards(self, checkpoint: str, roles: list[str]) -> None:
        """Read what `save_shards` wrote (by any number of workers: DCP reshards) into this
        worker's roles; the engine then takes the actor's weights (collective)."""
        for role in roles:
            folder = Path(checkpoint) / SHARDS / role
            if role == "ref":
                load_sharded(folder, self.ref.model)
                self.ref.synced = True
                continue
            r = self._trained(role)
            load_sharded(folder, r.model, r.optimizer)
            state = torch.load(folder / ROLE_STATE, map_location="cpu", weights_only=True)
            r.scheduler.load_state_dict(state["scheduler"])
            r.steps = state["steps"]
        if self.rollout is not None and self.actor is not None:  # colocated: the engine reads the actor's weights
            self.rollout.sync_weights(self.actor.model)


def per_rank_shares(batch: RLBatch, mini_batch_rows: int, epochs: int, seed: int, world_size: int) -> list[list[RLBatch]]:
    """The update's mini-batches, cut as the local roles cut them (`shuffled_mini_batches`),
    each shared out by tokens: entry r lists worker r's share of every mini-batch."""
    minis = [shard_rows(m, world_size, pad=False).parts for m in shuffled_mini_batches(batch, mini_batch_rows, epochs, seed)]
    return [[parts[r] for parts in minis] for r in range(world_size)]


def shard_roles(roles: Roles) -> list[str]:
    """The roles a checkpoint of a grouped run holds as DCP shards: the actor, the critic, and
    the reference once synced (before, a resume rebuilds it from the initial policy)."""
    names = ["actor"] + (["critic"] if roles.critic is not None else [])
    return names + (["ref"] if roles.ref is not None and roles.ref.synced else [])


def _by_group(roles: Roles, names: list[str]) -> list[tuple[Any, list[str]]]:
    """`names` (actor, critic, ref) by the worker group that holds them: the critic's pool for
    the critic, the actor's for the actor and its reference."""
    out: dict[int, tuple[Any, list[str]]] = {}
    for name in names:
        group = roles.critic.group if name == "critic" else roles.actor.group
        out.setdefault(id(group), (group, []))[1].append(name)
    return list(out.values())


def write_shards(roles: Roles, checkpoint: Path) -> None:
    """Every worker of each pool writes its roles' shards into the unsealed `checkpoint`
    folder; returns once all have (`save_checkpoint` seals it after)."""
    for group, names in _by_group(roles, shard_roles(roles)):
        group.one_to_all("save_shards", str(checkpoint), names)


def load_shards(roles: Roles, checkpoint: Path) -> None:
    """Every worker reads the checkpoint's shards, whatever the worker count that wrote them;
    a rollout pool of its own then loads the actor's weights; the driver's mirrors are
    refreshed from worker 0 when next read."""
    names = [n for n in ("actor", "critic", "ref") if (checkpoint / SHARDS / n).is_dir()]
    for group, held in _by_group(roles, names):
        group.one_to_all("load_shards", str(checkpoint), held)
    if roles.rollout.own_pool:
        roles.rollout.sync_from(roles.actor)
    roles.actor._updated()
    if roles.critic is not None:
        roles.critic._updated()
    if "ref" in names:
        roles.ref._synced = roles.ref._stale = True


class _Mirrored:
    """A trained role (`role`: actor or critic) over the group; `mirror` is a driver-side
    role object over the initial weights, whose model, optimizer and scheduler take worker
    0's state when read after an update."""

    role = ""

    def __init__(self, group: Any, mirror: Actor | Critic):
        self.group, self.mirror = group, mirror
        self._stale: set[str] = set()

    def _updated(self) -> None:
        self._stale = {"model", "optimizer"}

    def forget(self) -> None:
        """New workers (`restart_workers`): the mirror is read from worker 0 again."""
        self._updated()

    def _fetch(self, part: str) -> None:
        if part not in self._stale:
            return
        state = self.group.rank_zero("state", self.role, part)
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
    def steps(self) -> int:
        return int(self.group.rank_zero("steps", self.role))

    @steps.setter
    def steps(self, value: int) -> None:
        """After a restore: the mirror's state (just loaded) goes to every worker."""
        m = self.mirror
        self.group.one_to_all("load_state", self.role, {
            "model": {k: v.detach().cpu() for k, v in m.model.state_dict().items()},
            "optimizer": m.optimizer.state_dict(), "scheduler": m.scheduler.state_dict(), "steps": value,
        })
        m.steps, self._stale = value, set()


class RayActor(_Mirrored):
    """The actor role over the group (module doc)."""

    role = "actor"

    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr), as `Actor.compute_logprobs`, computed over the workers."""
        batch.require(*FORWARD_FIELDS, role="actor.compute_logprobs")
        return self.group.dp_compute("actor_logprobs", batch)

    def update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, kl_coef: float, seed: int) -> dict[str, float]:
        """`Actor.update` over the workers: the same mini-batches, each shared out by tokens."""
        self.mirror.require_update_fields(batch, mini_batch_rows, epochs)
        shares = per_rank_shares(batch, mini_batch_rows, epochs, seed, self.group.world_size)
        results = self.group.per_rank("update", [(s, kl_coef) for s in shares])
        self._updated()
        return results[0]  # reduced over the workers inside each step: the same on every worker

    @property
    def lr(self) -> float:
        return float(self.group.rank_zero("lr"))


class RayCritic(_Mirrored):
    """The critic role over the group (a separate value model on every worker)."""

    role = "critic"
    shared = False

    def compute_values(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr), as `Critic.compute_values`, computed over the workers."""
        batch.require(*FORWARD_FIELDS, role="critic.compute_values")
        return self.group.dp_compute("critic_values", batch)

    def update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, seed: int) -> dict[str, float]:
        """`Critic.update` over the workers: the same mini-batches, each shared out by tokens."""
        batch.require(*FORWARD_FIELDS, "values", "returns", role="critic.update")
        shares = per_rank_shares(batch, mini_batch_rows, epochs, seed, self.group.world_size)
        results = self.group.per_rank("critic_update", [(s,) for s in shares])
        self._updated()
        return results[0]


@dataclass(frozen=True)
class EngineInfo:
    kind: str
    """The engine every worker runs (native, hf)."""


class RayRollout:
    """The rollout role over the group: generation (single-turn or episodes) on worker 0, or
    split over the workers (`split`: rollout.dispatch, with rollout.seed_mode=row), sync on
    every worker. `env_factory` and `limits` are the workers' (evaluation reads them).
    `own_pool`: the group is a pool of its own (placement.rollout), whose engines run over
    copies of the policy, not over the actor's."""

    def __init__(self, group: Any, params: SamplingParams, kind: str, env_factory: Any = None,
                 limits: MultiTurnLimits | None = None, split: bool = False, own_pool: bool = False):
        if split and params.seed_mode != "row":
            raise ValueError("a split rollout needs SamplingParams.seed_mode='row' (rollout.seed_mode=row)")
        self.group, self.params, self.engine = group, params, EngineInfo(kind)
        self.env_factory, self.limits, self.split = env_factory, limits or MultiTurnLimits(), split
        self.own_pool = own_pool
        self._next_uid = 0

    def generate(self, prompts: RLBatch, seed: int, params: SamplingParams | None = None) -> RLBatch:
        """`Rollout.generate` over the group; the uids are counted here, as one `Rollout` counts
        them (the workers' own counters see their slices only)."""
        prompts.require("prompt_ids", "prompt_mask", "prompts", role="rollout.generate")
        uid = torch.arange(self._next_uid, self._next_uid + len(prompts))
        self._next_uid += len(prompts)
        if self.split:
            out = join_slices(self.group.dp_split("generate_slice", prompts, seed, params))
        else:
            out = self.group.rank_zero("generate", prompts, seed, params)
        return out.replace(uid=uid.repeat_interleave(len(out) // len(prompts)))

    def offload(self) -> None:
        """Colocated: every engine gives its memory to the update. A pool of its own has
        nothing to give (the update runs elsewhere)."""
        if not self.own_pool:
            self.group.one_to_all("offload")

    def sync_from(self, actor: Any) -> None:
        """Colocated: each worker's engine takes its own actor's weights, in place. The
        driver's mirror of the actor is not read (that would fetch worker 0's weights every
        step): the workers hold the same weights. A pool of its own: the actor's worker 0
        gives its weights once (one state dict in Ray's object store, not through the
        driver) and every rollout worker loads them."""
        if not self.own_pool:
            self.group.one_to_all("sync_weights")
            return
        self.group.one_to_all("load_weights", actor.group.rank_zero_ref("policy_weights"))


def join_slices(slices: list[RLBatch]) -> RLBatch:
    """The generated slices of one batch as one batch, rows in order; episodes' metrics merged
    as over several rounds (`envs.merge_episode_metrics`: means weighted by rows)."""
    from posttrain.envs import merge_episode_metrics

    out = RLBatch.concat(slices)
    if "episode_metrics" in out.meta:
        out.meta["episode_metrics"] = merge_episode_metrics([(len(b), b.meta["episode_metrics"]) for b in slices])
    return out


class RayReference:
    """π_ref over the group (each worker holds its copy, or its adapter-disabled policy).
    `model`, read for a checkpoint once synced, is a driver-side copy of `template` (the
    policy's module) holding worker 0's reference weights."""

    def __init__(self, group: Any, shares_policy: bool, template: torch.nn.Module):
        self.group, self.shares_policy, self.template = group, shares_policy, template
        self._mirror: torch.nn.Module | None = None
        self._synced = self._stale = False

    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        batch.require(*FORWARD_FIELDS, role="ref.compute_logprobs")
        return self.group.dp_compute("ref_logprobs", batch)

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO's ref ← α·policy + (1 − α)·ref on every worker, each with its own actor
        (`policy`, the driver's mirror, is not sent: the workers hold the same weights)."""
        self.group.one_to_all("ref_sync", alpha)
        self._synced = self._stale = True

    @property
    def model(self) -> torch.nn.Module:
        if self._mirror is None:
            self._mirror = copy.deepcopy(self.template).eval().requires_grad_(False)
        if self._stale:
            self._mirror.load_state_dict(self.group.rank_zero("state", "ref", "model"))
            self._stale = False
        return self._mirror

    @property
    def synced(self) -> bool:
        """True once the reference moved away from the initial policy (checkpoints save it)."""
        return self._synced

    @synced.setter
    def synced(self, value: bool) -> None:
        """After a restore loaded a synced reference into `model`: it goes to every worker."""
        if value:
            sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            self.group.one_to_all("load_state", "ref", {"model": sd})
        self._synced = value

    def forget(self) -> None:
        """New workers (`restart_workers`) hold the initial reference: so does the mirror, once read."""
        self._synced, self._stale = False, True

    def saved_model(self) -> torch.nn.Module | None:
        """The module a checkpoint holds once synced (None: rebuilt from the initial policy)."""
        return self.model if self._synced else None


def pool_factories(cfg: RLConfig, tokenizer: Any, policy: torch.nn.Module, value_model: ScalarHeadModel | None,
                   env_factory: Any, mapping: dict[str, str]) -> dict[str, tuple]:
    """Each pool's `Colocated` arguments (pool name → args): the roles mapped to it, and only
    the models they need (a critic pool gets no policy; a pool without the critic, no value
    model)."""
    out = {}
    for pool in dict.fromkeys(mapping.values()):
        roles = tuple(r for r in ALL_ROLES if mapping.get(r) == pool)
        needs_policy = "actor" in roles or "rollout" in roles
        out[pool] = (cfg, tokenizer, policy if needs_policy else None, value_model if "critic" in roles else None,
                     env_factory if needs_policy else None, roles)
    return out


def build_ray_roles(cfg: RLConfig, tokenizer: Any, policy: torch.nn.Module, reward: Reward,
                    value_model: ScalarHeadModel | None = None, env_factory: Any = None,
                    make_group: Any = None) -> Roles:
    """Start the workers of every resource pool (`RLConfig.resource_pools`: each worker
    builds `Colocated` over its pool's roles from the initial `policy`, `value_model` and
    `env_factory`) and the driver-side roles over them; the reward stays here.
    `make_group(Colocated, *args)` replaces each pool's Ray group (e.g. a `LocalWorkerGroup`)."""
    from posttrain.distributed.pools import WorkerPools
    from posttrain.rollout import engine_kind_for

    t = cfg.trainer
    specs, mapping = cfg.resource_pools()
    args = pool_factories(cfg, tokenizer, policy, value_model, env_factory, mapping)
    if make_group is None:
        from posttrain.distributed.pools import start_ray_pools
        from posttrain.distributed.ray_session import import_ray
        from posttrain.rewards.registry import pickle_file_modules_by_value

        pickle_file_modules_by_value(import_ray().cloudpickle)  # before the arguments are pickled
        pools = start_ray_pools({name: (GroupSpec(
            p.nnodes, p.n_workers_per_node, p.cpus_per_worker, cfg.ray.address, cfg.ray.num_cpus,
            t.collective_timeout_s,
            gpus_per_worker=cfg.placement.gpus_per_worker, roles=pool_label(cfg, mapping, name),
            restartable=t.on_worker_failure == "restart", section=p.section, cpus_key=p.cpus_key),
            Colocated, args[name]) for name, p in specs.items()})
    else:
        pools = WorkerPools({name: make_group(Colocated, *a) for name, a in args.items()})
    episodes = env_factory is not None
    actor = RayActor(pools[mapping["actor"]], Actor(policy, cfg, t.max_steps - cfg.critic.warmup_steps,
                                                    episodes=episodes))
    critic = None
    if value_model is not None:
        critic = RayCritic(pools[mapping["critic"]], Critic(value_model, cfg, t.max_steps))
    ref = RayReference(pools[mapping["actor"]], is_peft(policy), policy) if cfg.algorithm.kl.enabled else None
    kind = engine_kind_for(policy) if cfg.rollout.engine == "auto" else cfg.rollout.engine
    limits = MultiTurnLimits.from_config(cfg.rollout.multi_turn)
    rollout = RayRollout(pools[mapping["rollout"]], sampling_params(cfg), kind, env_factory, limits,
                         split=cfg.rollout.split, own_pool=mapping["rollout"] != mapping["actor"])
    return Roles(actor, rollout, reward, ref, critic, pools)


def pool_label(cfg: RLConfig, mapping: dict[str, str], pool: str) -> str:
    """What a pool's workers hold, for error messages ("actor, rollout, reference")."""
    with_ref = {**mapping, "reference": mapping["actor"]} if cfg.algorithm.kl.enabled else mapping
    return ", ".join(r for r in ("actor", "rollout", "reference", "critic") if with_ref.get(r) == pool)
