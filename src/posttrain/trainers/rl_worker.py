"""The RL worker: one class per process holding the roles it hosts, each method declaring how
the driver calls it (`distributed.register`).

trainer.backend=local runs ONE `RLWorker` in the driver's process (a `LocalWorkerGroup`);
trainer.backend=ray runs N of them, one per Ray worker (`rl_ray.start_worker_pools`). The
driver calls the views generated from the declarations below (`rl_build.Roles`), the same
on both backends:

    rollout.generate(prompts, seed)   RANK_ZERO   worker 0 samples the whole batch (or plays
                                                  every episode, rollout.env), so the tokens
                                                  are one worker's, exactly
                                      DP_SPLIT    rollout.dispatch=split (rollout.seed_mode=row):
                                                  worker r samples a contiguous slice of the
                                                  prompts, each row drawing by its index in
                                                  the batch; the slices joined in order
    rollout.play_in_parts(prompts,    RANK_ZERO   partial rollouts of episodes: as generate, in
      seed, handle, ...)              DP_SPLIT    parts, each worker keeping its slice's episodes
                                                  and environments between calls
    actor.compute_logprobs(batch)     DP_COMPUTE  token-balanced parts, gathered to (B, Tr)
    ref.compute_logprobs(batch)       DP_COMPUTE
    critic.compute_values(batch)      DP_COMPUTE
    critic.update(batch, rows, ...)   DP_SHARES   every worker cuts the mini-batches as one
    actor.update(batch, rows, ...)    DP_SHARES   process would (`shuffled_mini_batches`) and
                                                  trains on its token-balanced share of each
                                                  (`update_share`); `train_step`'s collective
                                                  all-reduces the weight Σw, the gradients and
                                                  the metrics, so each optimizer step is the
                                                  whole mini-batch's
    ref.sync(alpha)                   ONE_TO_ALL  every reference moves towards its own actor
    rollout.offload / sync_weights    ONE_TO_ALL  every colocated engine takes its own actor's
                                                  weights (fsdp2: one gathered parameter at a time)
    actor.send_weights /              ONE_TO_ALL  a rollout pool of its own: actor worker 0 streams
    rollout.receive_weights                       the weights in buckets over a weight group that
                                                  joins it and the rollout workers (the two calls
                                                  run at once, `rl_roles.PoolSync`; fsdp2: every
                                                  actor worker gathers one parameter at a time)
    actor.evaluate_task(rows, ...)    RANK_ZERO   eval.task on worker 0's policy (fsdp2: its
                                      ONE_TO_ALL  engine's whole copy; with no engine in the pool,
                                                  every worker gathers into worker 0's CPU copy)
    actor.describe()                  RANK_ZERO   class, counts, dtype, signature, engine kind
    save_hf(folder, final)            ONE_TO_ALL  each pool's worker 0 writes the HF folders of
                                                  a checkpoint or final/ from its own modules
                                                  (fsdp2: every worker gathers each parameter
                                                  in turn into worker 0's CPU copy)
    actor.model(), critic.model(),    ONE_TO_ALL  worker 0's module, for the Python API only
    ref.saved_model()                             (in process: the worker's own; Ray: a CPU copy)
    save_shards / restore             ONE_TO_ALL  every worker writes / reads its roles' DCP
                                                  shards (model + AdamW; resharded on load)

Exactness (tests/trainers/test_rl_ray.py): W workers give the parameters of one worker after
3 steps in float64 within 1e-10: the global update is
    g = (1/W) Σ_r Σ_{k∈r} ∇(w_k L_k) · W / Σ_k w_k = Σ_k ∇(w_k L_k) / Σ_k w_k,
one worker's whatever the shares (`distributed.collectives`).

Checkpoints, on both backends (docs/distributed.md "Checkpoints"): every worker writes each
trained role's model and AdamW state as DCP shards into `dcp/<role>/` of the unsealed folder,
worker 0 the schedule and step count (`role_state.pt`); a resume reads them, resharded to
any worker count. A checkpoint written before this layout (trainer_state.pt holding the
optimizer, `critic/optimizer.pt`) is read by every worker from its files (`restore`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from posttrain.checkpoint import RunModels, load_checkpoint
from posttrain.config.rl import RLConfig
from posttrain.distributed.checkpoint import SHARDS, load_sharded, save_sharded
from posttrain.distributed.dispatch import shard_rows
from posttrain.distributed.fsdp import (
    full_copy,
    offload_optimizer,
    policies,
    reshard,
    shard_model,
    skeleton,
    stream_full,
)
from posttrain.distributed.register import Dispatch, register
from posttrain.models.heads import ScalarHeadModel
from posttrain.models.lora import is_peft, merged_for_export, parameter_counts
from posttrain.rollout import MultiTurnLimits, SamplingParams
from posttrain.trainers.rl_build import build_initial_models, build_reference, build_rollout
from posttrain.trainers.rl_pool_weights import PoolWeights
from posttrain.workers import Actor, Critic, RLBatch, head_on_policy
from posttrain.workers.actor import shuffled_mini_batches
from posttrain.workers.forward import device_of

ALL_ROLES = ("actor", "rollout", "critic")
ROLE_STATE = "role_state.pt"
"""Next to a trained role's DCP shards: {"scheduler": its state_dict, "steps": n}."""


def update_share(batch: RLBatch, mini_batch_rows: int, epochs: int, seed: int, rank: int,
                 world_size: int) -> list[RLBatch]:
    """Worker `rank`'s share of each of the update's mini-batches: they are cut as one process
    cuts them (`shuffled_mini_batches`), then each is shared out by tokens (`shard_rows`,
    unpadded); every worker computes the same cut. One worker: the mini-batches themselves."""
    minis = shuffled_mini_batches(batch, mini_batch_rows, epochs, seed)
    if world_size == 1:
        return minis
    return [shard_rows(m, world_size, pad=False).parts[rank] for m in minis]


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are CPU tensors, made tensor by tensor
    (`deepcopy` takes them from its memo), so the module is never copied on its device."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


def join_slices(slices: list[RLBatch]) -> RLBatch:
    """The generated slices of one batch as one batch, rows in order; episodes' metrics merged
    as over several rounds (`envs.merge_episode_metrics`: means weighted by rows)."""
    from posttrain.envs import merge_episode_metrics

    out = RLBatch.concat(slices)
    if "episode_metrics" in out.meta:
        out.meta["episode_metrics"] = merge_episode_metrics([(len(b), b.meta["episode_metrics"]) for b in slices])
    return out


def ended_slices(slices: list[RLBatch | None]) -> RLBatch | None:
    """`play_in_parts`' slices joined (`join_slices`) once every one has ended, else None."""
    return None if any(s is None for s in slices) else join_slices(slices)


class RLWorker(PoolWeights):
    """The roles of one worker process, those of its pool (`roles`; all of them by default):
    actor + reference, critic, rollout. `policy` and `value_model` are the driver's initial
    modules (the same objects in process, copies on Ray; None where the pool does not hold
    their role); `env_factory` plays episodes (None: single-turn). The rollout's engine runs
    over the actor's policy when both are here, else over this worker's own copy of it
    (`receive_weights`). critic.share_backbone (one process only): the value head sits on the
    policy's backbone and trains in the actor's loss."""

    def __init__(self, rank: int, world_size: int, collective: Any, cfg: RLConfig, tokenizer: Any,
                 policy: torch.nn.Module | None, value_model: ScalarHeadModel | None = None, env_factory: Any = None,
                 roles: tuple[str, ...] = ALL_ROLES):
        needs_policy = "actor" in roles or "rollout" in roles
        if (policy is None and needs_policy) or (value_model is None and "critic" in roles and cfg.use_critic
                                                  and not cfg.critic.share_backbone):
            policy, value_model = own_models(cfg, tokenizer, policy, value_model, critic="critic" in roles)
            policy = policy if needs_policy else None
        self.in_process = collective is None  # the driver's own process (trainer.backend=local)
        if self.in_process and policy is not None and "rollout" in roles and "actor" not in roles:
            # a rollout pool of its own samples from its own copy, as a Ray worker does: loading the
            # actor's weights into it must not write into the module the actor is training
            policy = copy.deepcopy(policy)
        self.cfg = cfg
        self.rank, self.world_size, self.policy = rank, world_size, policy
        self.tokenizer, self.env_factory = tokenizer, env_factory
        self.limits = MultiTurnLimits.from_config(cfg.rollout.multi_turn)
        self.ref = self.actor = self.critic = self.rollout = None
        self.sharded = cfg.trainer.strategy == "fsdp2" and collective is not None
        """trainer.strategy=fsdp2 on Ray workers: the models are sharded over their group
        (`distributed.fsdp`; one worker too: its bf16 compute and offload apply)."""
        if collective is not None:  # FSDP2's backward averages the gradients itself
            collective.average_gradients = not self.sharded
        self.collective = collective
        self.init_pool_weights()
        self.templates: dict[str, torch.nn.Module] = {}
        """Of each sharded model, its structure on the meta device (`fsdp.full_copy` reads into it)."""
        episodes = env_factory is not None
        self.engine_model = policy
        """The module the rollout engine samples from: the policy, or under fsdp2 a whole copy
        of its own (`sync_weights`)."""
        if self.sharded and "rollout" in roles and "actor" in roles:
            self.engine_model = copy.deepcopy(policy)
        if "actor" in roles:
            self.ref = build_reference(cfg, policy)  # before training: a copy of the initial policy
            if self.ref is not None:
                if not self.ref.shares_policy:  # LoRA: the sharded policy with its adapter off
                    self._shard("ref", self.ref.model)
                self.ref.collective = collective if self.sharded else None
            self._shard("actor", policy)
        if "critic" in roles and cfg.use_critic:
            if cfg.critic.share_backbone:
                self.critic = Critic(head_on_policy(policy), cfg, cfg.trainer.max_steps, policy=policy)
            else:
                self._shard("critic", value_model)
                self.critic = Critic(value_model, cfg, cfg.trainer.max_steps, collective=collective)
        if "actor" in roles:
            shared = self.critic is not None and self.critic.shared
            self.actor = Actor(policy, cfg, cfg.trainer.max_steps - cfg.critic.warmup_steps, collective=collective,
                               extra_params=self.critic.model.score if shared else None, episodes=episodes)
            if shared:
                self.actor.joint = self.critic.joint_forward
        if self.sharded and cfg.trainer.fsdp.optimizer_offload:
            for r in (self.actor, self.critic):
                if r is not None and r.optimizer is not None:
                    offload_optimizer(r.optimizer)
        if "rollout" in roles:
            self.rollout = build_rollout(cfg, self.engine_model, tokenizer, env_factory)  # the engine last

    def _shard(self, role: str, model: torch.nn.Module) -> None:
        """Shard `model` over the workers under fsdp2 (bf16 compute on CUDA, offload as
        trainer.fsdp says), keeping its meta-device structure for full copies; else nothing."""
        if not self.sharded:
            return
        self.templates[role] = skeleton(model)
        t = self.cfg.trainer
        shard_model(model, *policies(t.precision, device_of(model), t.fsdp.param_offload))

    def _full(self, role: str, model: torch.nn.Module | None) -> torch.nn.Module | None:
        """`model` whole, for the driver: sharded, gathered parameter by parameter into a CPU
        copy that worker 0 returns (every worker calls it); else worker 0's own."""
        if model is None or not self.sharded:
            return self._readable(model) if self.rank == 0 else None
        return full_copy(model, self.templates[role], keep=self.rank == 0)

    # ------------------------------------------------------------------ rollout

    @register(Dispatch.RANK_ZERO, Dispatch.DP_SPLIT, when="split", role="rollout", name="generate", collect=join_slices)
    def generate(self, prompts: RLBatch | None, first: int, seed: int,
                 params: SamplingParams | None = None) -> RLBatch | None:
        """Responses to `prompts`, whose first prompt is the batch's `first` (None: no prompts
        for this worker)."""
        return None if prompts is None else self.rollout.generate(prompts, seed, params, first)

    @register(Dispatch.RANK_ZERO, Dispatch.DP_SPLIT, when="split", role="rollout", name="play_in_parts",
              collect=ended_slices)
    def play_in_parts(self, prompts: RLBatch | None, first: int, seed: int, handle: int, begin: bool, tokens: int,
                      version: int, live: list[int]) -> RLBatch | None:
        """Partial rollouts of episodes (`Rollout.play_in_parts`): this worker's slice of batch
        `handle` goes on for up to `tokens` model tokens per episode; its batch once all ended.
        The same slices at every call (`prompts` as at the start): each worker keeps its own
        episodes and environments."""
        if prompts is None:
            return None
        return self.rollout.play_in_parts(prompts, seed, handle, begin, tokens, version, live, first)

    @register(Dispatch.ONE_TO_ALL, role="rollout", name="offload")
    def offload(self) -> None:
        self.rollout.offload()

    @register(Dispatch.ONE_TO_ALL, role="rollout", name="sync_weights")
    def sync_weights(self) -> None:
        """The engine samples from this worker's actor's current weights: in place, or, under
        fsdp2, copied into its own module one gathered parameter at a time (`fsdp.stream_full`)."""
        self._engine_takes_actor()

    def _engine_takes_actor(self) -> None:
        if self.sharded:
            stream_full(self.actor.model, self.engine_model)
            self.rollout.sync_weights(self.engine_model)
        else:
            self.rollout.sync_weights(self.actor.model)

    @register(Dispatch.ONE_TO_ALL, role="rollout", name="close")
    def close_engine(self) -> None:
        """At the end of the run: an engine that holds something outside this process (e.g. a
        vLLM server's weight group) lets it go; the others have nothing to close."""
        close = getattr(self.rollout.engine, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ actor and reference

    @register(Dispatch.DP_COMPUTE, role="actor", name="compute_logprobs")
    def actor_logprobs(self, batch: RLBatch) -> torch.Tensor:
        return self._freed(self.actor.model, self.actor.compute_logprobs(batch))

    def _freed(self, model: torch.nn.Module, out: Any) -> Any:
        """`out`, after a sharded model's no-grad pass gave back its gathered root."""
        if self.sharded:
            reshard(model)
        return out

    @register(Dispatch.DP_SHARES, role="actor", name="update")
    def actor_update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, kl_coef: float,
                     seed: int) -> dict[str, float]:
        self.actor.require_update_fields(batch, mini_batch_rows, epochs)
        shares = update_share(batch, mini_batch_rows, epochs, seed, self.rank, self.world_size)
        return self.actor.update_mini_batches(shares, kl_coef)

    @register(Dispatch.RANK_ZERO, role="actor", name="lr")
    def actor_lr(self) -> float:
        return self.actor.lr

    @register(Dispatch.RANK_ZERO, Dispatch.ONE_TO_ALL, when="gathered_eval", role="actor", name="evaluate_task")
    def evaluate_task(self, rows: list[dict[str, Any]], task: str, max_new_tokens: int, batch_size: int,
                      temperature: float) -> tuple[dict[str, float], list[dict[str, Any]]] | None:
        """eval.task on worker 0's policy (`evaluation.evaluate_task`: the task's scorer on
        completions of `rows`, episodes when the run plays them): (metrics, samples). Under
        fsdp2 the policy is the engine's whole copy; with the engine on a pool of its own, every
        worker gathers (ONE_TO_ALL) into worker 0's CPU copy (`fsdp.full_copy`), freed after."""
        from posttrain.evaluation import evaluate_task

        model = self.engine_model if self.sharded else self.actor.model  # fsdp2: the engine's whole copy
        if self.sharded and self.rollout is None:
            model = full_copy(self.actor.model, self.templates["actor"], keep=self.rank == 0)
            if model is None:
                return None
        was_training = model.training
        model.eval()
        try:
            return evaluate_task(model, self.tokenizer, rows, task, max_new_tokens, batch_size, temperature,
                                 self.env_factory, self.limits)
        finally:
            model.train(was_training)

    @register(Dispatch.RANK_ZERO, role="actor", name="describe")
    def describe(self) -> dict[str, str]:
        """What the driver says of the policy without holding it: its class, parameter counts,
        device and dtype (the setup line), `model_signature` (the run's record) and the
        engine kind `rollout.engine=auto` picks."""
        from posttrain.checkpoint import model_signature
        from posttrain.rollout import engine_kind_for

        model = self.actor.model
        base = model.get_base_model() if is_peft(model) else model
        first = next(model.parameters())
        return {"class": type(base).__name__, "counts": parameter_counts(model), "device": str(first.device),
                "dtype": str(first.dtype), "signature": model_signature(model), "kind": engine_kind_for(model),
                "peft": is_peft(model)}

    def _readable(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        """`model` for the driver: itself in process, else a copy on the CPU (made without a
        second copy on the worker's device)."""
        return model if self.in_process or model is None else cpu_copy(model)

    @register(Dispatch.ONE_TO_ALL, role="actor", name="model")
    def actor_model(self) -> torch.nn.Module | None:
        return self._full("actor", self.actor.model)

    @register(Dispatch.DP_COMPUTE, role="ref", name="compute_logprobs")
    def ref_logprobs(self, batch: RLBatch) -> torch.Tensor:
        return self._freed(self.ref.model, self.ref.compute_logprobs(batch))

    @register(Dispatch.ONE_TO_ALL, role="ref", name="sync")
    def ref_sync(self, alpha: float) -> None:
        """Sharded: each worker mixes its own shards (the two models are sharded alike)."""
        if self.sharded:
            reshard(self.actor.model)
            reshard(self.ref.model)
        self.ref.sync(self.actor.model, alpha)

    @register(Dispatch.ONE_TO_ALL, role="ref", name="saved_model")
    def ref_saved_model(self) -> torch.nn.Module | None:
        """A synced reference's module (None before a sync), for the Python API as `actor.model()`."""
        return self._full("ref", self.ref.saved_model())

    # ------------------------------------------------------------------ critic

    @register(Dispatch.DP_COMPUTE, role="critic", name="compute_values")
    def critic_values(self, batch: RLBatch) -> torch.Tensor:
        return self._freed(self.critic.model, self.critic.compute_values(batch))

    @register(Dispatch.DP_SHARES, role="critic", name="update")
    def critic_update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, seed: int) -> dict[str, float]:
        if self.critic.shared:  # the actor's update trains it
            return {}
        batch.require("values", "returns", role="critic.update")
        return self.critic.update_mini_batches(update_share(batch, mini_batch_rows, epochs, seed, self.rank,
                                                            self.world_size))

    @register(Dispatch.ONE_TO_ALL, role="critic", name="model")
    def critic_model(self) -> torch.nn.Module | None:
        return self._full("critic", self.critic.model)

    # ------------------------------------------------------------------ checkpoints

    def _trained(self, role: str) -> Actor | Critic:
        return self.actor if role == "actor" else self.critic

    def _optimized(self, role: str) -> torch.nn.Module:
        """The module whose parameters `role`'s optimizer steps: the actor's policy, plus the
        value head of a critic on its backbone (one optimizer trains both)."""
        r = self._trained(role)
        if role == "actor" and self.critic is not None and self.critic.shared:
            return torch.nn.ModuleList([r.model, self.critic.model.score])
        return r.model

    def _held(self) -> list[str]:
        """The roles this worker writes: actor (and a synced reference), a separate critic."""
        names = ["actor"] if self.actor is not None else []
        if self.critic is not None and not self.critic.shared:
            names.append("critic")
        return names + (["ref"] if self.ref is not None and self.ref.synced else [])

    @register(Dispatch.ONE_TO_ALL)
    def save_shards(self, checkpoint: str) -> None:
        """Write each held role's state into `checkpoint`/dcp/<role>/ (collective: every worker
        of the pool calls it): the weights and AdamW's state as DCP shards (`ref`: the
        weights), and, from worker 0, the schedule and step count (`ROLE_STATE`). A critic on
        the policy's backbone is the actor's model and optimizer already."""
        for role in self._held():
            folder = Path(checkpoint) / SHARDS / role
            if role == "ref":
                save_sharded(folder, self.ref.model)
                continue
            r = self._trained(role)
            save_sharded(folder, self._optimized(role), r.optimizer)
            if self.rank == 0:
                torch.save({"scheduler": r.scheduler.state_dict(), "steps": r.steps}, folder / ROLE_STATE)

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, folder: str, final: bool) -> None:
        """The HF folders of what this worker's pool holds, written by its worker 0 into `folder`
        (collective: every worker of the pool calls it; under fsdp2 each gathers its shards of
        every parameter in turn into worker 0's CPU copy, `fsdp.full_copy`: the extra peak on a
        worker's device is one parameter). A checkpoint (final=False): the policy (a LoRA
        policy: its adapter), a synced reference in `reference/`, the critic in `critic/`.
        `final/` (final=True): the policy merged for export, its LoRA adapter in `adapter/`,
        the critic. Unsharded, worker 0 writes from its own modules: no copy, the files the
        driver wrote before."""
        models = self._hf_models(final)
        if models is not None and self.rank == 0:
            models.save_pretrained(folder)

    def _whole(self, role: str, model: torch.nn.Module | None) -> torch.nn.Module | None:
        """`model` whole on worker 0: itself, or under fsdp2 its gathered CPU copy (every
        worker calls it; None elsewhere)."""
        if model is None or not self.sharded:
            return model
        return full_copy(model, self.templates[role], keep=self.rank == 0)

    def _hf_models(self, final: bool) -> RunModels | None:
        """`RunModels` of this worker's roles (None: a rollout pool's worker writes nothing)."""
        critic = self._whole("critic", self.critic.model) if self.critic is not None else None
        if self.actor is None:
            return None if critic is None else RunModels(None, critic, with_optimizer=False)
        policy = self._whole("actor", self.actor.model)
        if final:
            if policy is None:  # not worker 0
                return None
            return RunModels(merged_for_export(policy), critic, adapter=policy if is_peft(policy) else None,
                             with_optimizer=False)
        ref = self._whole("ref", self.ref.saved_model()) if self.ref is not None else None
        return RunModels(policy, critic, reference=ref, with_optimizer=False)

    @register(Dispatch.ONE_TO_ALL)
    def restore(self, checkpoint: str, step: int) -> None:
        """Load checkpoint `checkpoint` (of step `step`) into this worker's roles: the DCP shards
        `save_shards` wrote (by any number of workers: DCP reshards), or a checkpoint of the
        layout before them (`restore_files`); the engine then takes the actor's weights."""
        path = Path(checkpoint)
        if (path / SHARDS).is_dir():
            self._restore_shards(path)
        elif self.sharded:
            raise ValueError(f"trainer.strategy=fsdp2: {path} was written before the DCP layout (no {SHARDS}/), "
                             "whose whole-model files sharded workers do not read; resume it once with "
                             "trainer.strategy=ddp (its next checkpoint has the layout), then with fsdp2")
        else:
            self.restore_files(path, step)
        if self.rollout is not None and self.actor is not None:  # colocated: the engine reads the actor's weights
            self._engine_takes_actor()

    def _restore_shards(self, path: Path) -> None:
        for role in ("actor", "critic", "ref"):
            folder = path / SHARDS / role
            if role == "ref":
                if self.ref is not None and folder.is_dir():
                    load_sharded(folder, self.ref.model)
                    self.ref.synced = True
                continue
            r = self._trained(role)
            if r is None or (role == "critic" and r.shared):
                continue
            load_sharded(folder, self._optimized(role), r.optimizer)
            state = torch.load(folder / ROLE_STATE, map_location="cpu", weights_only=True)
            r.scheduler.load_state_dict(state["scheduler"])
            r.steps = state["steps"]

    def restore_files(self, path: Path, step: int) -> None:
        """A checkpoint written before the DCP layout (one process: the policy's HF files,
        trainer_state.pt with its AdamW state, `critic/` with `optimizer.pt`, `reference/`),
        read from its files by every worker. The actor's step count is the RL steps past the
        critic's warmup (it was not saved then)."""
        if self.actor is not None:
            load_checkpoint(path, self.actor.model, self.actor.optimizer, self.actor.scheduler, restore_rng=False)
            self.actor.steps = max(0, step - self.actor.cfg.critic.warmup_steps)
        if self.critic is not None and not self.critic.shared:
            RunModels.load_critic(path, self.critic)
        if self.ref is not None:
            RunModels.load_reference(path, self.ref)


def own_models(cfg: RLConfig, tokenizer: Any, policy: torch.nn.Module | None, value_model: Any,
               critic: bool) -> tuple[torch.nn.Module, Any]:
    """A Ray worker's initial models when the driver built none (`rl_build.initial_models`
    with build=False): built here, from the same seed as the driver would (trainer.seed, as
    `setup.prepare_run` seeds it before building), so every worker starts from the same weights."""
    from posttrain.training.core import set_seed

    set_seed(cfg.trainer.seed)
    built, value = build_initial_models(cfg, tokenizer, policy, value_model, critic=critic)
    return built, value_model if value_model is not None else value


def pool_factories(cfg: RLConfig, tokenizer: Any, policy: torch.nn.Module, value_model: ScalarHeadModel | None,
                   env_factory: Any, mapping: dict[str, str]) -> dict[str, tuple]:
    """Each pool's `RLWorker` arguments (pool name → args): the roles mapped to it, and only
    the models they need (a critic pool gets no policy; a pool without the critic, no value
    model)."""
    out = {}
    for pool in dict.fromkeys(mapping.values()):
        roles = tuple(r for r in ALL_ROLES if mapping.get(r) == pool)
        needs_policy = "actor" in roles or "rollout" in roles
        out[pool] = (cfg, tokenizer, policy if needs_policy else None, value_model if "critic" in roles else None,
                     env_factory if needs_policy else None, roles)
    return out
