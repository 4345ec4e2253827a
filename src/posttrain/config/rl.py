"""The online-RL config tree, shared by `posttrain grpo` and `posttrain ppo`.

One tree covers PPO (critic + GAE), GRPO, DAPO, GSPO, Dr.GRPO, RLOO and REINFORCE++:
an algorithm is a choice of `algorithm.adv_estimator` plus actor-loss and sampling
settings (see `recipes/*.yaml`). PPO is `adv_estimator=gae`, which turns the critic on.

Batch sizes, as veRL counts them:
    data.train_batch_size          prompts per RL step (one rollout)
    rollout.n                      responses per prompt → train_batch_size · n rows
    actor.ppo_mini_batch_size      prompts per optimizer step → ppo_mini_batch_size · n rows;
                                   train_batch_size / ppo_mini_batch_size optimizer steps per
                                   epoch, `actor.ppo_epochs` epochs per RL step
    actor.micro_batch_size         rows (responses) per forward/backward; gradients of a
                                   mini-batch accumulate exactly (the update does not depend on it)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, ClassVar, Literal

from posttrain.config.algorithm import (  # noqa: F401  (KLConfig, OverlongConfig: their old import path)
    AlgorithmConfig,
    KLConfig,
    OverlongConfig,
    PolicyLossConfig,
    PPOAlgorithmConfig,
)
from posttrain.config.aliases import aliases, openrlhf, trl, verl
from posttrain.config.asyncrl import AsyncConfig
from posttrain.config.core import check, iter_fields
from posttrain.config.placement import (
    GLOBAL_POOL,
    RAY_ONLY,
    FSDPConfig,
    PlacementConfig,
    RayConfig,
    ResourcePool,
)
from posttrain.config.rollout import RolloutConfig, check_vllm_temperature
from posttrain.config.sections import RLModelConfig, TrainerConfig, check_divides


@dataclass
class RLDataConfig:
    """Prompts: a `prompt` column (a string or chat messages) plus any extra columns,
    which reach the reward functions as keyword arguments (as TRL)."""

    train_files: list[str] = field(default_factory=list, metadata=aliases(
        trl("train_dataset", same_value=False, note="the trainer's argument: pass the files here"),
        verl("data.train_files"), openrlhf("prompt_data")))
    """Training prompts: JSONL, JSON, Parquet or CSV files, or a saved `datasets` folder."""
    eval_files: list[str] = field(default_factory=list, metadata=aliases(
        trl("eval_dataset", same_value=False, note="the trainer's argument: pass the files here"),
        verl("data.val_files"), openrlhf("eval_dataset")))
    """Held-out prompts for evaluation (same formats)."""
    prompt_key: str = field(default="prompt", metadata=aliases(verl("data.prompt_key"), openrlhf("input_key")))
    """Column holding the prompt."""
    max_prompt_length: int = field(default=512, metadata=aliases(
        trl("max_prompt_length"), verl("data.max_prompt_length"), openrlhf("prompt_max_len")))
    """Longest prompt in tokens (BOS / chat template included)."""
    truncation: Literal["error", "left", "drop"] = "error"
    """A longer prompt is an error naming the row (`error`, veRL's default), keeps its last
    max_prompt_length tokens (`left`), or is dropped (`drop`); cut or dropped prompts are
    counted in the metrics `data/n_truncated` and `data/n_dropped`."""
    train_batch_size: int = field(default=32, metadata=aliases(
        trl("gradient_accumulation_steps", same_value=False, note=(
            "set the prompts per RL step, data.train_batch_size (TRL's per_device_train_batch_size × "
            "gradient_accumulation_steps × ranks ÷ num_generations); actor.ppo_mini_batch_size and "
            "actor.micro_batch_size cut it, and the accumulation follows")),
        verl("data.train_batch_size"), openrlhf("rollout_batch_size")))
    """Prompts per RL step; each gets rollout.n responses."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (seeded by trainer.seed)."""

    def validate(self) -> None:
        check(self.max_prompt_length > 0, "data.max_prompt_length", "must be > 0")
        check(self.train_batch_size > 0, "data.train_batch_size", f"must be > 0, got {self.train_batch_size}")


@dataclass
class ActorConfig:
    """Updating the policy on a rollout. Its learning rate and schedule are `trainer.*`."""

    ppo_mini_batch_size: int | None = field(default=None, metadata=aliases(
        verl("actor_rollout_ref.actor.ppo_mini_batch_size"),
        trl("num_mini_batches", same_value=False, note="ppo_mini_batch_size = data.train_batch_size ÷ num_mini_batches"),
        trl("steps_per_generation", same_value=False,
            note="ppo_mini_batch_size = data.train_batch_size ÷ steps_per_generation")))
    """Prompts per optimizer step (× rollout.n rows); must divide data.train_batch_size.
    null = data.train_batch_size: one optimizer step per epoch (fully on-policy)."""
    micro_batch_size: int = field(default=8, metadata=aliases(
        trl("per_device_train_batch_size"), verl("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
        openrlhf("micro_train_batch_size")))
    """Rows (responses) per forward/backward; must divide ppo_mini_batch_size · rollout.n.
    Memory only: the update is the same for any value."""
    max_tokens_per_micro_batch: int = field(default=0, metadata=aliases(
        verl("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        verl("actor_rollout_ref.actor.use_dynamic_bsz", same_value=False,
             note="use_dynamic_bsz=true with ppo_max_token_len_per_gpu=N is actor.max_tokens_per_micro_batch=N")))
    """Dynamic batching: cut micro-batches by token count instead of micro_batch_size
    (0 = off): padded tokens (rows × width), or real tokens with model.use_remove_padding.
    Also used for the log-prob and value passes."""
    ppo_epochs: int = field(default=1, metadata=aliases(
        trl("num_iterations"), trl("num_ppo_epochs"), verl("actor_rollout_ref.actor.ppo_epochs"),
        openrlhf("max_epochs")))
    """Passes over each rollout; mini-batches are reshuffled each pass."""
    entropy_coeff: float = field(default=0.0, metadata=aliases(
        verl("actor_rollout_ref.actor.entropy_coeff"), openrlhf("entropy_loss_coef")))
    """Weight of the entropy bonus: loss −= entropy_coeff · entropy (aggregated as the policy loss)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The clipped surrogate loss."""

    def validate(self) -> None:
        check(self.micro_batch_size >= 1, "actor.micro_batch_size", "must be >= 1")
        check(self.ppo_epochs >= 1, "actor.ppo_epochs", "must be >= 1")
        check(self.max_tokens_per_micro_batch >= 0, "actor.max_tokens_per_micro_batch", "must be >= 0")
        check(self.ppo_mini_batch_size is None or self.ppo_mini_batch_size >= 1,
              "actor.ppo_mini_batch_size", "must be >= 1 (or null)")


@dataclass
class CriticConfig:
    """The value model of PPO: a backbone plus a scalar head (`posttrain.models.heads`)."""

    enable: bool | None = None
    """Train a critic; null = exactly when algorithm.adv_estimator is gae (the only estimator that uses one)."""
    model_path: str | None = field(default=None, metadata=aliases(
        verl("critic.model.path"), openrlhf("critic_pretrain")))
    """Initial critic: a saved value/reward model directory, whose weights must hold its
    score head (see fresh_head); null = the policy's initial weights with a fresh scalar head."""
    fresh_head: bool = False
    """Start critic.model_path's critic with a fresh (zero) value head on its backbone, so the
    folder may be a plain causal LM. False = it must be a critic or reward model, whose trained
    head the critic starts from; a folder without one is an error."""
    share_backbone: bool = False
    """Put the value head on the policy's own backbone: one forward, one optimizer, and the
    loss policy + vf_coef · value (TRL's old value-head models). False = a separate model."""
    learning_rate: float | None = field(default=None, metadata=aliases(
        verl("critic.optim.lr"), openrlhf("critic_learning_rate")))
    """Critic learning rate (null = trainer.learning_rate); the schedule is trainer's."""
    value_clip: float | None = field(default=0.5, metadata=aliases(
        trl("cliprange_value"), verl("critic.cliprange_value"), openrlhf("value_clip")))
    """Clip the new values to old ± value_clip in the loss (veRL 0.5, TRL 0.2); null = off."""
    vf_coef: float = field(default=0.1, metadata=aliases(trl("vf_coef")))
    """Weight of the value loss: in the joint loss when share_backbone (TRL 0.1), else it
    scales the critic's own loss (with AdamW that mainly changes when grad clipping bites)."""
    warmup_steps: int = field(default=0, metadata=aliases(verl("trainer.critic_warmup")))
    """RL steps at the start that train only the critic."""
    micro_batch_size: int | None = field(default=None, metadata=aliases(
        verl("critic.ppo_micro_batch_size_per_gpu")))
    """Rows per critic forward/backward (null = actor.micro_batch_size)."""

    def validate(self) -> None:
        check(self.learning_rate is None or self.learning_rate > 0, "critic.learning_rate", "must be > 0")
        check(self.value_clip is None or self.value_clip > 0, "critic.value_clip", "must be > 0 (or null)")
        check(self.vf_coef > 0, "critic.vf_coef", f"must be > 0, got {self.vf_coef}")
        check(self.warmup_steps >= 0, "critic.warmup_steps", "must be >= 0")
        check(self.micro_batch_size is None or self.micro_batch_size >= 1, "critic.micro_batch_size", "must be >= 1")
        check(not self.fresh_head or self.model_path is not None, "critic.fresh_head",
              "applies to critic.model_path only (the default critic already starts with a fresh head)")


@dataclass
class RewardConfig:
    """Scoring responses: reward functions (TRL signature) and/or a trained reward model."""

    functions: list[str | dict[str, Any]] = field(default_factory=list, metadata=aliases(
        trl("reward_funcs", same_value=False, note="name them as reward.functions=[name,file.py:function]"),
        verl("custom_reward_function.path", same_value=False,
             note="path=F with name=G is reward.functions=[F:G]")))
    """Reward functions: built-in names (task_reward, math_accuracy, format_reward, …),
    `{name: ..., option: ...}` mappings, or `module:function` / `file.py:function` paths."""
    weights: list[float] | None = field(default=None, metadata=aliases(trl("reward_weights")))
    """One weight per function (null = all 1.0)."""
    timeout_s: float = 10.0
    """Seconds a reward function may take on a batch (per-sample retries get as long again)."""
    failure_reward: float = 0.0
    """Reward of a sample whose reward function raised or timed out (counted in reward/<fn>/errors)."""
    isolation: Literal["thread", "process"] = "thread"
    """Where the reward functions run. thread: in the trainer's process, each call in a thread;
    a raise, a `sys.exit` or a call past timeout_s fails its samples, but `os._exit`, a
    segfault or the OOM killer ends the run, and a hung call keeps its thread. process: each
    call in a pool of worker processes (the functions and their arguments must pickle), so
    those also fail only their samples; the dead or hung worker is killed and replaced. The
    built-in functions (the reward model included) always run in the trainer's process."""
    model_path: str | None = field(default=None, metadata=aliases(
        trl("reward_model_path"), verl("reward_model.model.path"), openrlhf("reward_pretrain")))
    """A trained reward model directory (`posttrain rm`); its score is added to the functions' total."""
    model_weight: float = 1.0
    """Weight of the reward model's score."""
    missing_eos_penalty: float | None = field(default=None, metadata=aliases(trl("missing_eos_penalty")))
    """Subtract this from the score of a response truncated before a stop token (TRL); null = off."""

    def validate(self) -> None:
        check(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        check(self.weights is None or len(self.weights) == len(self.functions), "reward.weights",
              f"needs one weight per reward function ({len(self.functions)}), got {self.weights}")
        check(self.missing_eos_penalty is None or self.missing_eos_penalty >= 0, "reward.missing_eos_penalty",
              "must be >= 0 (it is subtracted)")


@dataclass
class RLEvalConfig:
    """Held-out evaluation every trainer.eval_steps steps (and at the end)."""

    task: str | None = None
    """A bundled task (e.g. arithmetic): eval/accuracy is its scorer on greedy completions,
    the same number `posttrain sft` reports. null = score with the reward functions."""
    num_examples: int = 200
    """Eval prompts used (the first N of data.eval_files)."""
    max_new_tokens: int | None = None
    """Tokens generated per eval prompt (null = rollout.max_new_tokens)."""
    temperature: float = 0.0
    """Eval sampling temperature (0 = greedy)."""
    batch_size: int = field(default=64, metadata=aliases(trl("per_device_eval_batch_size")))
    """Prompts decoded at once."""

    def validate(self) -> None:
        check(self.num_examples > 0 and self.batch_size > 0, "eval.num_examples", "num_examples and batch_size must be > 0")


@dataclass
class RLTrainerConfig(TrainerConfig):
    """The shared optimisation options plus where the RL roles run (veRL's names)."""

    backend: Literal["local", "ray"] = "local"
    """Where the roles run. `local`: every role in this process (Ray is never imported).
    `ray`: actor, rollout, reference and critic colocated in one Ray actor per worker (veRL's
    hybrid engine; placement.critic / placement.rollout give the critic or the rollout workers
    of their own), trainer.nnodes × trainer.n_workers_per_node workers joined in one gloo
    torch.distributed group; the actor's and critic's updates, the log-prob and value passes
    are data-parallel over them, and give the update of the local backend (exact: loss
    normalised by the all-reduced global weight). The driver, the reward and the prompt
    stream stay in this process. Generation (multi-turn episodes included) runs on worker 0
    of the rollout's pool (the local backend's tokens, exactly), or split over that pool's
    workers with rollout.seed_mode=row (rollout.dispatch; the local backend's tokens with the
    same seed_mode). The vllm engine runs in every worker: on its GPU (placement.gpus_per_worker)
    with vLLM's CUDA build, on CPU workers with its CPU build. Not with
    critic.share_backbone. Ray starts locally on 127.0.0.1 unless ray.address says otherwise."""
    nnodes: int = field(default=1, metadata=aliases(verl("trainer.nnodes")))
    """Nodes of the Ray cluster the workers span (trainer.backend=ray)."""
    n_workers_per_node: int = field(default=1, metadata=aliases(verl("trainer.n_gpus_per_node")))
    """Worker processes per node (trainer.backend=ray; on a CPU a
    worker is a process with placement.cpus_per_worker threads)."""
    collective_timeout_s: float = 600.0
    """How long a torch.distributed collective between the workers may wait (trainer.backend=ray).
    A worker that dies is detected within seconds whatever this says (trainer.on_worker_failure)."""
    on_worker_failure: Literal["stop", "restart"] = "stop"
    """What a run does when a Ray worker dies (killed, out of memory, its node lost; detected
    within seconds; trainer.backend=ray). `stop`: the workers are killed and the run stops
    with an error naming the dead worker (rank, pid, roles) and the last complete checkpoint,
    from which a rerun resumes. `restart`: new workers are started and the run goes on from
    the last complete checkpoint (or from the start when there is none), up to
    trainer.max_restarts times; the metric `worker_restarts` counts them."""
    max_restarts: int = 1
    """How many times one run restarts its workers (trainer.on_worker_failure=restart) before
    it stops as `stop` would."""
    async_training: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchronous RL: generation overlapped with the update, bounded staleness (docs/async.md)."""
    strategy: Literal["none", "ddp", "fsdp2"] = field(default="ddp", metadata=aliases(
        verl("actor_rollout_ref.actor.strategy", same_value=False, note="veRL's fsdp/fsdp2 is trainer.strategy=fsdp2")))
    """How the workers hold the actor, reference and critic (the key SFT/RM/DPO use). `ddp`:
    a whole copy on each worker, gradients averaged over them after each backward. `fsdp2`:
    sharded over the workers (`fully_shard` per decoder layer, then the root;
    `distributed.fsdp`): each holds 1/W of every weight, gradient and AdamW moment; on CUDA
    bf16 compute with fp32 master weights and reduction (trainer.precision). `none`: one
    worker (trainer.backend=local, or one Ray worker). All three give the same update."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Offload of the fsdp2 shards (CUDA workers)."""

    def validate(self) -> None:
        super().validate()
        check(self.nnodes >= 1, "trainer.nnodes", f"must be >= 1, got {self.nnodes}")
        check(self.n_workers_per_node >= 1, "trainer.n_workers_per_node", f"must be >= 1, got {self.n_workers_per_node}")
        check(self.collective_timeout_s > 0, "trainer.collective_timeout_s", "must be > 0 seconds")
        check(self.max_restarts >= 0, "trainer.max_restarts", f"must be >= 0, got {self.max_restarts}")
        check(self.strategy != "none" or self.world_size == 1, "trainer.strategy",
              f"none holds the models in one process, and this run has {self.world_size} workers: set "
              "trainer.strategy=ddp (a copy on each) or fsdp2 (sharded over them)")

    @property
    def world_size(self) -> int:
        """Data-parallel workers: nnodes × n_workers_per_node (1 on the local backend)."""
        return self.nnodes * self.n_workers_per_node if self.backend == "ray" else 1


@dataclass
class GRPOTrainerConfig(RLTrainerConfig):
    """The shared optimisation options, in GRPO's own run directory."""

    output_dir: str = "runs/grpo"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/ are written here. It
    holds one run: each command defaults to its own (runs/sft, runs/rm, runs/dpo, ...)."""


@dataclass
class PPOTrainerConfig(RLTrainerConfig):
    """The shared optimisation options, in PPO's own run directory."""

    output_dir: str = "runs/ppo"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/ are written here. It
    holds one run: each command defaults to its own (runs/sft, runs/rm, runs/dpo, ...)."""


@dataclass
class RLConfig:
    """Online RL: PPO (critic + GAE) and the critic-free GRPO family (GRPO, DAPO, GSPO,
    Dr.GRPO, RLOO, REINFORCE++), chosen by algorithm.adv_estimator and the actor's loss."""

    command: ClassVar[str] = "rl"  # checkpoints record it (resume checks it); GRPOConfig, PPOConfig set theirs

    model: RLModelConfig = field(default_factory=RLModelConfig)
    """The policy (its initial weights are also the reference)."""
    data: RLDataConfig = field(default_factory=RLDataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (PPO)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL, DAPO tricks, rollout correction."""
    trainer: RLTrainerConfig = field(default_factory=RLTrainerConfig)
    """Steps, optimizer (the actor's), schedule, logging, checkpoints. max_steps, warmup
    and the schedule count RL steps; micro-batches are actor.micro_batch_size."""
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)
    """Held-out evaluation."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Resource pools: which roles share workers, and each worker's CPUs (trainer.backend=ray)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster (trainer.backend=ray)."""

    def validate(self) -> None:
        d, a, n = self.data, self.actor, self.rollout.n
        est = self.algorithm.adv_estimator
        # The root cause first: with n = 1 the micro-batch arithmetic below may fail too.
        check(n >= 2 or not self.algorithm.estimator.grouped, "rollout.n",
              f"{est} compares the responses of a prompt: needs rollout.n >= 2, got {n}")
        check(n >= 2 or not self.algorithm.filter_groups, "rollout.n", "algorithm.filter_groups needs rollout.n >= 2")
        mini = self.mini_batch_prompts
        check_divides(d.train_batch_size, "data.train_batch_size", mini, "actor.ppo_mini_batch_size")
        if not a.max_tokens_per_micro_batch:
            check_divides(mini * n, "actor.ppo_mini_batch_size·rollout.n", a.micro_batch_size, "actor.micro_batch_size")
            if self.critic.micro_batch_size is not None:
                check_divides(mini * n, "actor.ppo_mini_batch_size·rollout.n",
                              self.critic.micro_batch_size, "critic.micro_batch_size")
        self._validate_critic(est)
        if self.trainer.backend == "ray":
            self._validate_ray(mini * n)
        check(self.rollout.dispatch != "split" or self.trainer.backend == "ray", "rollout.dispatch",
              "split generation divides a batch over Ray workers: set trainer.backend=ray, or "
              "rollout.dispatch=auto for one process")
        ray_keys = self.ray_keys_set()
        check(self.trainer.backend == "ray" or not ray_keys, ", ".join(ray_keys),
              f"{'apply' if len(ray_keys) > 1 else 'applies'} to Ray workers only: set trainer.backend=ray, or "
              f"drop {'them' if len(ray_keys) > 1 else 'it'} (trainer.backend=local runs every role in this one process)")
        self.check_overlong()
        corr = self.algorithm.rollout_correction
        check(not (corr.needs_rollout_logprobs and self.rollout.calculate_log_probs is False),
              "rollout.calculate_log_probs",
              f"algorithm.rollout_correction.{'rollout_is' if corr.rollout_is else 'bypass_mode'} reads the engine's "
              "log-probs: set rollout.calculate_log_probs=true, or leave it null (true when the correction is on)")
        self._validate_async()
        self.trainer.fsdp.check(self.trainer.strategy, self.cuda_workers)
        if self.rollout.engine == "vllm" and self.eval.task is None:  # eval samples through the engine
            problem = check_vllm_temperature(self.eval.temperature)
            check(problem is None, "eval.temperature", problem or "")

    def _validate_async(self) -> None:
        """Async RL needs the behaviour log-probs and one generation round per step."""
        k = self.trainer.async_training.max_staleness
        if not k:
            return
        check(self.rollout.calculate_log_probs is not False, "rollout.calculate_log_probs",
              f"trainer.async_training.max_staleness={k} records the behaviour policy's log-probs (the decoupled "
              "PPO objective weighs by them): set rollout.calculate_log_probs=true or leave it null")
        check(not self.algorithm.filter_groups, "algorithm.filter_groups",
              f"dynamic sampling draws extra generation rounds inside a step, which the async pipeline "
              f"(trainer.async_training.max_staleness={k}) does not schedule: set algorithm.filter_groups=false "
              "or trainer.async_training.max_staleness=0")
        if self.trainer.async_training.partial_rollout:
            self._validate_partial_rollout()

    def _validate_partial_rollout(self) -> None:
        """Partial rollouts resume a generation from its tokens so far (`trainers.rl_partial`): single-turn
        responses as new requests, episodes on the workers that hold them."""
        key = "trainer.async_training.partial_rollout"
        check(self.rollout.engine != "vllm", "rollout.engine",
              f"{key}=true needs an engine that resumes a row's random stream mid-response: rollout.engine=native "
              "or hf (vLLM seeds each request's stream at its first token, so a resumed segment would redraw the "
              f"first segment's randomness), or {key}=false")

    def check_partial_rollout(self, episodes: bool) -> None:
        """Partial rollouts of single-turn responses take no rollout.stop strings; episodes
        (`episodes`: the Python API's environment_factory / tools, or rollout.env / rollout.tools)
        keep each turn's tokens on the worker between segments and do. Checked where the trainer
        knows whether it plays episodes (`trainers.rl_build.check_reward_source`)."""
        key = "trainer.async_training.partial_rollout"
        check(not self.trainer.async_training.partial_rollout or episodes or self.rollout.episodes
              or not self.rollout.stop, "rollout.stop",
              f"{key}=true generates single-turn responses in segments, and a stop string split over two of them "
              f"would be missed: end responses with rollout.stop_token_ids instead, or set {key}=false (multi-turn "
              "episodes, rollout.env / rollout.tools, keep each turn's tokens between segments and take stop strings)")

    @property
    def cuda_workers(self) -> bool:
        """The workers train on CUDA: it is here, model.device is not cpu, and on Ray each
        worker has a GPU share (placement.gpus_per_worker)."""
        import torch

        gpus = self.trainer.backend == "local" or self.placement.gpus_per_worker > 0
        return torch.cuda.is_available() and self.model.device != "cpu" and gpus

    def ray_keys_set(self) -> list[str]:
        """The keys of RAY_ONLY (and of its sections) set to something other than their default."""
        return [key for key, _, default, _ in iter_fields(type(self))
                if any(key == k or key.startswith(k + ".") for k in RAY_ONLY) and attrgetter(key)(self) != default]

    def check_overlong(self, episodes: bool = False) -> None:
        """DAPO's overlong buffer fits in the response limit its penalty counts model tokens
        against: rollout.max_new_tokens, or for episodes (`episodes`: the Python API's
        environment_factory / tools, or rollout.env / rollout.tools set) the episode's model-token
        limit `rollout.max_response_tokens`."""
        buffer, r = self.algorithm.overlong.buffer, self.rollout
        limit = r.max_response_tokens(episodes)
        where = (f"rollout.max_new_tokens={r.max_new_tokens}" if not (episodes or r.episodes) else
                 f"the episode's model-token limit {limit} = min(rollout.multi_turn.max_turns "
                 f"{r.multi_turn.max_turns} × rollout.max_new_tokens {r.max_new_tokens}, "
                 f"rollout.multi_turn.max_total_tokens {r.multi_turn.max_total_tokens})")
        check(buffer <= limit, "algorithm.overlong.buffer", f"must be <= {where}, got {buffer}")

    def _validate_critic(self, est: str) -> None:
        c = self.critic
        check(not (self.use_critic and c.enable is False), "critic.enable",
              f"algorithm.adv_estimator={est} needs the critic (critic.enable=true or null)")
        check(self.use_critic or not c.enable, "critic.enable",
              f"algorithm.adv_estimator={est} uses no critic: it would be trained for nothing")
        check(not (c.share_backbone and c.warmup_steps), "critic.warmup_steps",
              "critic-only warmup needs a separate critic (critic.share_backbone=false)")
        check(not (c.share_backbone and c.model_path), "critic.model_path",
              "a critic sharing the policy's backbone starts from the policy (drop critic.model_path)")
        check(not (c.share_backbone and self.model.lora.r), "critic.share_backbone",
              "a value head on a LoRA policy's backbone is not supported; use a separate critic")
        check(not (c.share_backbone and self.actor.policy_loss.loss_agg_mode == "seq-mean-token-sum-norm"),
              "critic.share_backbone", "the joint loss needs a loss_agg_mode other than seq-mean-token-sum-norm")
        if self.trainer.max_steps is not None:
            self.check_length()

    def check_length(self) -> None:
        """The checks that need trainer.max_steps (set, or filled from num_train_epochs by the trainer)."""
        check(self.critic.warmup_steps < self.trainer.max_steps, "critic.warmup_steps",
              f"must be < trainer.max_steps={self.trainer.max_steps}")

    def _validate_ray(self, mini_rows: int) -> None:
        """What the Ray backend runs: every algorithm with a separate critic; the vllm engine
        colocated with the actor (GPU workers, or CPU workers with vLLM's CPU build); a critic pool only for a run with a critic; every trained
        pool's worker gets a row of each mini-batch."""
        check(not (self.use_critic and self.critic.share_backbone), "critic.share_backbone",
              "a value head on the policy's backbone trains in the actor's loss and optimizer, which the Ray "
              "workers keep apart from the critic's; set critic.share_backbone=false (a separate critic) or "
              "trainer.backend=local")
        check(self.rollout.vllm_mode != "server", "rollout.vllm_mode",
              "server mode pushes the weights from the trainer's process to one vLLM server: run it with "
              "trainer.backend=local, or keep rollout.vllm_mode=colocate (an engine in every Ray worker)")
        check(self.rollout.engine != "vllm" or not self.placement.rollout.enable_resource_pool,
              "placement.rollout.enable_resource_pool",
              "a rollout pool of its own runs the native or hf engine; the vllm engine runs colocated with the actor")
        check(self.use_critic or not self.placement.critic.enable_resource_pool, "placement.critic.enable_resource_pool",
              f"algorithm.adv_estimator={self.algorithm.adv_estimator} trains no critic; set it false")
        pools, mapping = self.resource_pools()
        for name in {mapping["actor"], mapping.get("critic", mapping["actor"])}:
            p = pools[name]
            check(mini_rows >= p.world_size, f"{p.section}.n_workers_per_node",
                  f"every worker needs a row of each mini-batch: actor.ppo_mini_batch_size·rollout.n={mini_rows} "
                  f"< {p.world_size} workers ({p.section}.nnodes × {p.section}.n_workers_per_node)")

    def resource_pools(self) -> tuple[dict[str, ResourcePool], dict[str, str]]:
        """veRL's resource_pool_spec (pool name → its workers) and mapping (role → pool name)
        for trainer.backend=ray: the actor and its reference on global_pool
        (trainer.nnodes × trainer.n_workers_per_node), and there too the rollout and the critic
        (a run with one) unless placement.rollout / placement.critic give them a pool of their
        own (rollout_pool, critic_pool)."""
        pl, t = self.placement, self.trainer
        pools = {GLOBAL_POOL: ResourcePool(t.nnodes, t.n_workers_per_node, pl.cpus_per_worker, "trainer",
                                           "placement.cpus_per_worker")}
        roles = ["actor", "rollout"] + (["critic"] if self.use_critic else [])
        mapping = dict.fromkeys(roles, GLOBAL_POOL)
        for role in pl.own_pools():
            p, key = getattr(pl, role), f"placement.{role}"
            cpus, cpus_key = ((p.cpus_per_worker, f"{key}.cpus_per_worker") if p.cpus_per_worker is not None
                              else (pl.cpus_per_worker, "placement.cpus_per_worker"))
            pools[f"{role}_pool"] = ResourcePool(p.nnodes, p.n_workers_per_node, cpus, key, cpus_key)
            mapping[role] = f"{role}_pool"
        return pools, mapping

    @property
    def mini_batch_prompts(self) -> int:
        """actor.ppo_mini_batch_size, or data.train_batch_size when it is null."""
        return self.actor.ppo_mini_batch_size or self.data.train_batch_size

    @property
    def rollout_log_probs(self) -> bool:
        """rollout.calculate_log_probs, null resolved: the engine returns log-probs when the
        rollout correction reads them."""
        wanted = self.rollout.calculate_log_probs
        needed = self.algorithm.rollout_correction.needs_rollout_logprobs or self.trainer.async_training.enabled
        return needed if wanted is None else wanted

    @property
    def use_critic(self) -> bool:
        """The estimator reads a critic's values (gae), so the run trains one."""
        return self.algorithm.estimator.needs_values


@dataclass
class GRPOConfig(RLConfig):
    """GRPO and its relatives (DAPO, GSPO, Dr.GRPO, RLOO, REINFORCE++): no critic by default."""

    command: ClassVar[str] = "grpo"  # the `posttrain` command; checkpoints record it (resume checks it)

    trainer: GRPOTrainerConfig = field(default_factory=GRPOTrainerConfig)
    """Steps, optimizer (the actor's), schedule, logging, checkpoints. max_steps, warmup
    and the schedule count RL steps; micro-batches are actor.micro_batch_size."""


@dataclass
class PPORolloutConfig(RolloutConfig):
    """Sampling for PPO: one response per prompt by default (the critic is the baseline)."""

    n: int = 1
    """Responses per prompt."""


@dataclass
class PPOConfig(RLConfig):
    """PPO with a critic: algorithm.adv_estimator=gae and rollout.n=1 by default."""

    command: ClassVar[str] = "ppo"  # the `posttrain` command; checkpoints record it (resume checks it)

    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)
    """Steps, optimizer (the actor's), schedule, logging, checkpoints. max_steps, warmup
    and the schedule count RL steps; micro-batches are actor.micro_batch_size."""
    rollout: PPORolloutConfig = field(default_factory=PPORolloutConfig)
    """Sampling."""
    algorithm: PPOAlgorithmConfig = field(default_factory=PPOAlgorithmConfig)
    """Advantage estimator, KL, DAPO tricks, rollout correction."""
