"""Online RL: PPO with a critic and the GRPO family (GRPO, DAPO, GSPO, Dr.GRPO, RLOO, REINFORCE++).

One driver, `rl_step` (one step of the loop in `trainers/loop.py`), calls the roles in veRL's
order, through views generated from the worker's declarations (`rl_worker.RLWorker`: one
in-process worker locally, N on Ray; `rl_roles.Roles`, typed by `workers.roles`):

    prompts → rollout.generate (n per prompt) → reward.score → actor.compute_logprobs (old)
      → ref.compute_logprobs (only with a KL term) → critic.compute_values (PPO)
      → advantages (`algos.ADV_ESTIMATORS[algorithm.adv_estimator]`)
      → rollout.offload → critic.update → actor.update (ppo_epochs × shuffled mini-batches)
      → roles.sync_rollout() (each engine resumes, then takes its actor's new weights)

Papers: PPO (Schulman et al. 2017, arXiv 1707.06347) with GAE (arXiv 1506.02438); GRPO
(Shao et al. 2024, arXiv 2402.03300); DAPO (Yu et al. 2025, arXiv 2503.14476); GSPO
(Zheng et al. 2025, arXiv 2507.18071); Dr.GRPO (Liu et al. 2025, arXiv 2503.20783); RLOO
(Ahmadian et al. 2024, arXiv 2402.14740); REINFORCE++ (Hu 2025, arXiv 2501.03262). The
formulas are in `posttrain.algos`; `recipes/*.yaml` set each algorithm up.

"The loss is 0 on the first step" (TRL #2703, #3452). On the first pass over a fresh
rollout the policy is the behaviour policy: every ratio is exactly 1, so the clipped
loss is −mean(A), and group-normalised advantages average to 0 within each group, so
the logged `policy_loss` is ~0 (exactly 0 for seq-mean aggregations with equal-length
groups). Its gradient is not: ∇L = −mean(A · ∇log π), the plain policy gradient, which
is what moves the model. Watch `reward/mean`, `grad_norm` and `approx_kl`, not the loss.

Departures from the papers, TRL and veRL, and why:
- A non-finite loss, gradient or update (found by a dry run of the AdamW step) skips that
  optimizer step (actor or critic); the RL step is then bad: counted in `nonfinite_steps`,
  never checkpointed, and `trainer.max_bad_steps` bad RL steps in a row stop the run, as in
  every other command (the loop's guard).
- Batch sizes count as veRL's: data.train_batch_size prompts per step, ppo_mini_batch_size
  in prompts (× n rows) per optimizer step, micro_batch_size in rows. TRL counts
  completions per device. The lr schedule, warmup and max_steps count RL steps (veRL).
- Micro-batches combine exactly for every loss_agg_mode (weights from
  `algos.aggregation_weight`), so micro_batch_size and dynamic batching never change
  the update; Dr.GRPO's constant is rollout.max_new_tokens, not the batch's width.
- GRPO's std is the population std (÷G), not TRL/veRL's Bessel-corrected one (÷(G−1))
  (`algos.grpo_advantages`); eps 1e-6 as veRL (TRL 1e-4).
- Group estimators score the sequence reward after KL-in-reward (token rewards summed),
  as veRL; the KL penalty of the reward is applied in the advantage stage, once old and
  reference log-probs exist (veRL's `apply_kl_penalty`), not inside the reward call.
- Both KL placements may be on at once (veRL allows it too); a warning says so. One
  coefficient and one estimator serve both (default k1 in the reward, k3 in the loss).
- Dynamic sampling never loops forever: after algorithm.max_gen_batches rounds it trains
  on the groups it kept (or on the last round when it kept none), with a warning and
  the metrics dynamic_sampling/gen_batches and dynamic_sampling/kept_frac. The kept
  batch is cut to exactly data.train_batch_size groups, as veRL's DAPO recipe.
- Old log-probs are recomputed by the actor (veRL), or are the engine's in bypass mode
  (algorithm.rollout_correction.bypass_mode, veRL's). With one optimizer step per rollout
  (ppo_epochs 1, ppo_mini_batch_size = the batch), no KL in the reward and no comparison
  with the engine's log-probs (rollout.calculate_log_probs), there is no recompute at all:
  the loss uses its own log-probs, detached, which are exactly the behaviour policy's (TRL
  does the same when num_iterations = 1); the ratio is 1 and timing/old_logprob is 0.
- Rollout correction (`algos.rollout_correction`, docs/rollout_correction.md): with the
  engine's log-probs every step logs their gap to the actor's (rollout_corr/*, veRL's names),
  correction on or off; with algorithm.rollout_correction.rollout_is the weights (TIS,
  IcePop, MIS) multiply the policy-gradient term of the actor's loss. A masked token keeps
  its place in the loss's denominator (TRL); veRL's rejection takes it out of the mask.
- Asynchronous RL (trainer.async_training.max_staleness=K ≥ 1, `rl_async`, docs/async.md): the
  rollout generates the next K steps' batches while the actor trains; each token records its
  policy version; the old log-probs are always recomputed (π_prox) and the rollout correction's
  weight π_prox / π_behaviour is always applied (AReaL's decoupled PPO; token TIS when
  algorithm.rollout_correction.rollout_is is null). K = 0 is the synchronous loop, unchanged.
  With partial_rollout the batches are generated in segments (episodes kept on the rollout
  workers) and a sync reaches the one in flight (`rl_partial`): tokens of several versions.
- Rows whose advantage is 0 on every token (a GRPO group whose rewards are all equal) get
  no forward/backward when the loss is the clipped surrogate alone (no entropy bonus, no
  KL in the loss, no shared value head): their loss and gradient are exactly 0, and they
  still count in the aggregation's denominator, so the update is unchanged
  (`workers/actor.py`). `entropy` and the ratio metrics are then means over the rows that ran.
- A separate critic starts from the policy's weights with a zero value head (all values
  0 at first); TRL/veRL start from a reward model or a random head. critic.model_path
  overrides. With LoRA the reference is the base model with adapters disabled.
- A reward function that fails on every sample of the first step, or of trainer.max_bad_steps
  steps in a row, stops the run with its first traceback (TRL and veRL train on, learning
  nothing); its signature and the columns it needs are checked before the run
  (`rewards/checks.py`), and the end of the run logs each function's error and NaN counts.
- Multi-turn episodes (rollout.env / rollout.tools, `environment_factory=` as TRL): the
  trajectory is one response whose environment tokens have response_mask 0 (no loss, KL,
  entropy, nor token counts; GAE skips them), old/reference/current log-probs are over the
  whole sequence (`RLBatch.attention_mask` covers `total_lengths`), and the score sits on
  the trajectory's last token (a model token). Environment rewards are the reward function
  `env_reward` (the default when there is none), so `reward.weights` combines them with
  the others. Dr.GRPO's constant is then min(max_turns · max_new_tokens, max_total_tokens).
  TRL needs vLLM for this; here every engine runs it (`posttrain.envs`): native and hf token
  by token, vllm turn by turn (`rollout.episodes.run_turn_episodes`).
- Every RL metric is written every step: stages that did not run log their neutral
  value (`rl_steps.NOT_RUN`, timing 0), never NaN; a run without a critic (GRPO and its
  relatives) logs no critic metric (value_loss, critic/*, timing/values,
  timing/update_critic). Two are logged only where they mean something: `accuracy`, the
  fraction of samples that the first reward function declaring a correctness notion scores
  ≥ 1 (`workers/reward_worker.py`; the run's first log lines name it), and `kl_coef`, only
  with a KL term.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from posttrain.algos import AdaptiveKLController, FixedKLController
from posttrain.checkpoint import RunRecord, load_checkpoint, save_checkpoint, save_final
from posttrain.config.core import check
from posttrain.config.rl import GRPOConfig, PPOConfig, RLConfig
from posttrain.data.collate import pad_id_of
from posttrain.data.prompts import load_prompts
from posttrain.logging import get_logger
from posttrain.logging.metrics import PROMPTS_FILE
from posttrain.logging.timing import StageTimer
from posttrain.trainers.batches import EpochBatches
from posttrain.trainers.callbacks import Callbacks
from posttrain.trainers.loop import SAMPLES_PER_EVAL, FitResult, RefSync, StepOutput, run
from posttrain.trainers.rl_async import AsyncRollouts, Lane, collect_async, lane_metrics
from posttrain.trainers.rl_build import (
    check_reward_source,
    episode_source,
    evaluate_policy,
    load_final_models,
)
from posttrain.trainers.rl_faults import run_restarting
from posttrain.trainers.rl_partial import PartialRollout
from posttrain.trainers.rl_roles import build_roles
from posttrain.trainers.rl_samples import train_samples
from posttrain.trainers.rl_steps import (
    NOT_RUN,
    collect_rollouts,
    compute_advantages,
    correct_rollout,
    mask_truncated,
    step_seed,
    step_stages,
)
from posttrain.trainers.setup import prepare_run, python_inputs, set_train_length
from posttrain.workers import Reward, RLBatch

log = get_logger(__name__)

UPDATE_SALT = 1_000_000


class RLTrainer:
    """The RL run: roles, prompt stream, KL controller; `train()` runs the driver.

        trainer = GRPOTrainer(model, reward_funcs=[my_reward], args=GRPOConfig(...),
                              train_dataset=rows, eval_dataset=rows)
        trainer.train()

    `model`: a loaded module, a local model directory, or None (`args.model` says what
    to build); LoRA (`model.lora.r > 0`, or TRL's `peft_config=peft.LoraConfig(...)`)
    wraps any of them. `processing_class`: the tokenizer; by default that of the folder a
    module was loaded from, or of `model.path` (`models.factory.load_tokenizer`).
    `reward_funcs`: callables with TRL's signature or spec strings (built-in names,
    `module:function`); they replace `args.reward.functions`. Datasets are
    anything `posttrain.data.sources.load_rows` reads; when omitted, `args.data.*_files`.

    Multi-turn episodes (TRL's shape): `environment_factory` (a class or callable giving a
    fresh `posttrain.envs.Environment` per episode, or a spec string) and/or `tools`
    (functions or spec strings) replace `args.rollout.env` / `args.rollout.tools`:

        GRPOTrainer(model, reward_funcs=[task_reward()], args=cfg, train_dataset=rows,
                    environment_factory=MyEnv)              # or tools=[calculator]

    Without reward functions the environment's rewards are the reward (`env_reward`).
    Reward functions may read TRL's `trainer_state` and `log_metric` (`rewards.runner`).
    `callbacks`: transformers `TrainerCallback`s (`posttrain.trainers.callbacks`).
    """

    config_class: type[RLConfig] = RLConfig

    def __init__(
        self,
        model: torch.nn.Module | str | None = None,
        reward_funcs: Any = None,
        args: RLConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        value_model: torch.nn.Module | None = None,
        environment_factory: Any = None,
        tools: Any = None,
        peft_config: Any = None,
        callbacks: Sequence[Any] | None = None,
    ):
        self.args = args = args if args is not None else self.config_class()
        self.callbacks = Callbacks(callbacks, args)
        if reward_funcs is not None and not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        env_factory = episode_source(args, environment_factory, tools)
        train_source, eval_source, self.tokenizer = prepare_run(
            args, model, train_dataset, eval_dataset, processing_class,
            checks=lambda: check_reward_source(args, reward_funcs, episodes=env_factory is not None),
            peft_config=peft_config,
        )
        self.inputs = python_inputs(train_dataset, eval_dataset, reward_funcs, environment_factory,
                                    tools)  # recorded in config.yaml
        self.examples, self.data_stats = load_prompts(train_source, self.tokenizer, args.data)
        set_train_length(args, len(self.examples))
        self.eval_examples = None
        if eval_source is not None:
            self.eval_examples = load_prompts(eval_source, self.tokenizer, args.data)[0][: args.eval.num_examples]
        data = "train_dataset" if train_dataset is not None else f"data.train_files {list(args.data.train_files)}"
        self.roles = build_roles(args, self.tokenizer, model, reward_funcs, value_model,
                                 columns=list(self.examples[0]["columns"]), data=data, env_factory=env_factory)
        self.roles.reward.runner.trainer_state = self.callbacks.state  # TRL's reward argument (the reward
        # runs in this process)
        self.stream = EpochBatches(self.examples, args.data.train_batch_size, args.data.train_batch_size,
                                   partial(RLBatch.from_prompts, pad_id=pad_id_of(self.tokenizer)), seed=args.trainer.seed, shuffle=args.data.shuffle)
        kl = args.algorithm.kl
        self.kl_ctrl = (AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.adaptive
                        else FixedKLController(kl.coef))
        self.next_uid = 0  # the prompts' group ids, counted over the run
        self.pad_id = pad_id_of(self.tokenizer)
        self.pipeline = self._pipeline() if args.trainer.async_training.enabled else None
        self.given = (model, value_model)  # the modules passed in (None: built), for `model` after a Ray run
        self.trained: tuple[torch.nn.Module, torch.nn.Module | None] | None = None  # (policy, critic) after train()
        self.final_dir: Path | None = None  # after a Ray run: final/, where `model` reads the trained weights
        self.last_batch: RLBatch | None = None  # the latest training batch (its rows go to samples.jsonl)
        self.desc, self.start_metrics = "rl", self.data_stats
        self.has_eval = self.eval_examples is not None
        self.at_step = 0  # the step running (a worker failure names it)
        self.worker_restarts: int | None = None  # trainer.on_worker_failure=restart: the metric worker_restarts
        self.callbacks.init_end(self.callback_model, self.tokenizer)

    @property
    def model(self) -> torch.nn.Module:
        """Worker 0's policy: locally the one in-process worker's own module; on Ray a CPU copy
        fetched on demand (during the run from worker 0; after `train()`, when the workers are
        gone, loaded from final/: the driver holds no weights of its own)."""
        return self._models()[0]

    @property
    def value_model(self) -> torch.nn.Module | None:
        """Worker 0's critic (None without one), as `model`."""
        return self._models()[1]

    def _models(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        if self.trained is None and self.final_dir is not None:  # after a Ray run
            self.trained = load_final_models(self.args, self.tokenizer, *self.given, self.final_dir)
        if self.trained is not None:
            return self.trained
        r = self.roles
        return r.actor.model(), r.critic.model() if r.critic is not None else None

    @property
    def callback_model(self) -> torch.nn.Module | None:
        """The callbacks' `model`: the in-process worker's policy; None on Ray (its weights stay
        on the workers; `trainer.model` fetches a copy)."""
        return self.model if self.roles.in_process else None

    def model_signature(self) -> str:
        """The policy's `checkpoint.model_signature` (the run's record), from actor worker 0."""
        return self.facts["signature"]

    @property
    def epoch(self) -> float:
        """Passes over the prompts so far (fractional; DAPO's extra generation rounds count)."""
        return self.stream.epoch_progress

    @property
    def steps_per_epoch(self) -> float:
        return self.stream.steps_per_epoch

    def train(self) -> FitResult:
        """Run the RL loop (`trainers/loop.run`): trainer.max_steps steps of `rl_step`; a worker
        death (Ray) stops the run or restarts its workers (`rl_faults.run_restarting`)."""
        log.info("%s", self.setup_line())
        log.info("%s", self.accuracy_line())
        try:
            result = run_restarting(self, self._run)
            if self.roles.in_process:  # the modules stay readable; a Ray run's are read from final/
                self.trained = self._models()
            else:
                self.final_dir = result.final_dir
            return result
        finally:
            if self.pipeline is not None:
                self.pipeline.lane.close()  # before the workers it calls stop
            self.roles.close()  # the workers (and a Ray the run started) stop

    def _run(self, config: RLConfig) -> FitResult:
        a = config.algorithm
        return run(self, config, RefSync(a.ref_sync_steps, a.ref_sync_alpha), self.callbacks)

    def setup_line(self) -> str:
        """What is trained, on what, with what (as `posttrain sft` logs it), from actor worker 0."""
        a, f = self.args, self.facts
        name = a.model.path or (f"built-in {a.model.init}" if a.model.init else f["class"])
        return (f"RL ({a.algorithm.adv_estimator}): {name}, {f['counts']}; {len(self.examples)} prompts, "
                f"{a.trainer.max_steps} steps of {a.data.train_batch_size} x {a.rollout.n}; rollout engine "
                f"{self.roles.rollout.kind}, on {f['device']}, {f['dtype']}")

    @property
    def facts(self) -> dict[str, Any]:
        """What actor worker 0 says of its policy (`RLWorker.describe`)."""
        return self.roles.actor.describe()

    def accuracy_line(self) -> str:
        """Where `accuracy` comes from (`workers.reward_worker`), or why there is none."""
        source = self.roles.reward.accuracy_from
        if source is None:
            return ("no accuracy metric: no reward function declares a correctness notion (is_correctness = True, "
                    "as math_accuracy, exact_match, task_reward and code_tests do)")
        return f"accuracy: the fraction of samples that the reward function {source} scores >= 1"

    def step(self, step: int) -> StepOutput:
        self.at_step = step
        metrics, self.last_batch = rl_step(self, step)
        self._log_prompts(step, self.last_batch)
        if self.worker_restarts is not None:
            metrics["worker_restarts"] = float(self.worker_restarts)
        nonfinite = metrics.get("actor/nonfinite_steps", 0.0) + metrics.get("critic/nonfinite_steps", 0.0) > 0
        overflow = metrics.get("actor/overflow_steps", 0.0) + metrics.get("critic/overflow_steps", 0.0) > 0
        shown = {"reward": metrics["reward/mean"], "acc": metrics.get("accuracy"), "kl": metrics["kl"]}
        return StepOutput(metrics, nonfinite, overflow=overflow,
                          progress={k: v for k, v in shown.items() if v is not None})

    # ------------------------------------------------------------------ one step's stages

    def next_prompts(self, count: int | None = None) -> RLBatch:
        """The next data.train_batch_size prompts (`count`: that many), each with its group id
        (`uid`, counted over the run here, so a batch generated in slices by several workers
        keeps one numbering) and its index in the training prompts (`prompt_index`)."""
        prompts = self.prompts_of(self.stream.next_indices(count))
        uid = torch.arange(self.next_uid, self.next_uid + len(prompts))
        self.next_uid += len(prompts)
        return prompts.replace(uid=uid)

    def prompts_of(self, indices: list[int]) -> RLBatch:
        """The training prompts `indices`, collated, with their `prompt_index`."""
        prompts = RLBatch.from_prompts([self.examples[i] for i in indices], pad_id=self.pad_id)
        return prompts.replace(prompt_index=torch.tensor(indices, dtype=torch.long))

    def _pipeline(self) -> AsyncRollouts:
        """trainer.async_training (`rl_async`): the rollout's jobs run on a thread of their own
        where the rollout has a pool of its own (they then overlap the update), else in turn."""
        cfg, r = self.args, self.roles
        a = cfg.trainer.async_training

        def generate(prompts: RLBatch, step: int) -> RLBatch:
            return r.rollout.generate(prompts, step_seed(cfg.trainer.seed, step, 0))

        def sync() -> Any:
            if r.pool_sync is None:
                return r.rollout.sync_weights
            return r.pool_sync.staged_sync()  # the weights as they are now, streamed when the lane gets there

        log.info("async RL: max_staleness=%d (%s, stale_policy=%s); the rollout %s", a.max_staleness, a.mode,
                 a.stale_policy, "overlaps the update (a pool of its own)" if r.own_rollout_pool else
                 "runs in turn with the update (no pool of its own: the same schedule, no overlap)")
        partial_rollout = PartialRollout.of(cfg, r.rollout, self.tokenizer, self.pad_id) if a.partial_rollout else None
        return AsyncRollouts(a.max_staleness, a.stale_policy, cfg.rollout.n, Lane(threaded=r.own_rollout_pool),
                             self.next_prompts, generate, sync, partial_rollout)

    def _log_prompts(self, step: int, batch: RLBatch) -> None:
        """trained_prompts.jsonl: the step's prompts (one per group) and their policy versions."""
        n = self.args.rollout.n
        versions = batch.versions if batch.versions is not None else torch.full_like(batch.response_ids, step - 1)
        oldest = torch.where(batch.response_mask.bool(), versions, versions.amax()).amin(-1)
        record = {"step": step, "prompt_index": batch.prompt_index[::n].tolist(),
                  "version": oldest.view(-1, n).amin(-1).tolist()}
        run_dir = Path(self.args.trainer.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)  # `step` called outside the loop (tests) too
        with open(run_dir / PROMPTS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    @property
    def reference(self) -> Any:
        """The reference role (`loop.RefSync` checks and syncs it)."""
        return self.roles.ref

    def sync_reference(self, alpha: float) -> None:
        """TR-DPO's sync: every worker's reference moves towards its own actor."""
        self.roles.ref.sync(alpha)

    @property
    def on_policy_update(self) -> bool:
        """One optimizer step per rollout (one epoch, one mini-batch) and no KL in the reward:
        the update's own log-probs, detached, are the behaviour policy's, exactly (TRL with
        num_iterations=1), so the old-log-prob pass is skipped."""
        cfg = self.args
        single = cfg.actor.ppo_epochs == 1 and cfg.mini_batch_prompts == cfg.data.train_batch_size
        return single and not cfg.algorithm.kl.in_reward and self.pipeline is None  # async: π_prox ≠ π_behaviour

    @property
    def correction(self) -> Any:
        """algorithm.rollout_correction; in async RL its behaviour weight π_prox / π_behaviour is
        always applied (decoupled PPO): rollout_is=token (TIS) when it is null."""
        corr = self.args.algorithm.rollout_correction
        if self.pipeline is not None and corr.rollout_is is None and not corr.bypass_mode:
            return dataclasses.replace(corr, rollout_is="token")
        return corr

    def old_logprobs(self, batch: RLBatch) -> tuple[RLBatch, dict[str, float]]:
        """The behaviour policy's log-probs: the engine's in bypass mode; none when the update
        is on-policy (the actor uses its own, detached) and the engine's are not compared;
        else recomputed by the actor, then compared with the engine's and corrected for
        (`rl_steps.correct_rollout`) when the engine returned them (rollout.calculate_log_probs)."""
        cfg = self.args
        corr = self.correction
        if corr.bypass_mode:
            batch.require("rollout_logp", role="algorithm.rollout_correction.bypass_mode",
                          why="old log-probs are the engine's (rollout.calculate_log_probs)")
            return batch.replace(old_logp=batch.rollout_logp), {}
        if self.on_policy_update and not cfg.rollout_log_probs:
            return batch, {}
        batch = batch.replace(old_logp=self.roles.actor.compute_logprobs(batch))
        return correct_rollout(batch, corr) if cfg.rollout_log_probs else (batch, {})

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """eval/* metrics and the first eval samples (after the rollout's jobs in flight)."""
        if self.pipeline is not None:
            self.pipeline.lane.drain()
        metrics, samples = evaluate_policy(self, step)
        return metrics, samples[:SAMPLES_PER_EVAL]

    def train_samples(self) -> list[dict[str, Any]]:
        """The latest training batch's first rows, with their episodes (`rl_samples`)."""
        return train_samples(self.last_batch, self.tokenizer) if self.last_batch is not None else []

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, Any]:
        """Prompt stream position, KL coefficient, group ids; async: the prompts in flight."""
        out = {"prompts": self.stream.state_dict(), "kl_coef": self.kl_ctrl.value, "next_uid": self.next_uid}
        if self.pipeline is not None:
            out["in_flight"] = self.pipeline.state()
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        """The driver's state (`state()`): prompt stream position, KL coefficient, group ids, and
        the prompts in flight (async; also the state a worker restart goes back to)."""
        self.stream.load_state_dict(state["prompts"])
        self.kl_ctrl.value = float(state["kl_coef"])
        self.next_uid = int(state.get("next_uid", 0))
        self.last_batch = None
        if self.pipeline is not None:  # its prompts in flight are generated again (version: `restore` sets it)
            self.pipeline.load_state(state.get("in_flight", []), 0, self.prompts_of)

    def save(self, run_dir: Path, step: int, metrics: dict[str, float], keep: int, run: RunRecord) -> Path:
        """The HF folders written by each pool's worker 0 (`RLWorker.save_hf`); every worker's DCP
        shards of model + AdamW (`RLWorker.save_shards`: one layout on every backend and worker count)."""
        r = self.roles
        if self.pipeline is not None:  # the rollout pool's workers write shards too
            self.pipeline.lane.drain()
        return save_checkpoint(run_dir, step, HFFolders(r, final=False), self.tokenizer, None, None, self.state(),
                               keep, metrics, run,
                               write_shards=r.save_shards)

    def restore(self, path: Path) -> int:
        """Load checkpoint `path` into every worker's roles (`RLWorker.restore`) and the driver's
        state (prompt stream, KL coefficient, RNG); returns its step."""
        state = load_checkpoint(path, None)
        if self.pipeline is not None:
            self.pipeline.lane.drain()
        self.roles.restore(path, state["step"])
        self.load_state(state["data_state"])
        if self.pipeline is not None:  # the restored weights are version `step`
            self.pipeline.version = state["step"]
        return state["step"]

    def save_final(self, run_dir: Path) -> Path:
        """`final/`, at the end of the run: also where the reward functions' error counts are said."""
        r = self.roles
        runner = r.reward.runner
        failed = any(t.errors or t.nan for t in runner.tallies.values())
        log.log(logging.WARNING if failed else logging.INFO,
                "reward functions over the run (training and eval samples): %s", runner.summary())
        return save_final(run_dir, HFFolders(r, final=True), self.tokenizer)


class HFFolders:
    """`save_checkpoint`'s / `save_final`'s model: the HF folders of a checkpoint (final=False)
    or of final/ (True), written by each pool's worker 0 (`RLWorker.save_hf`)."""

    def __init__(self, roles: Any, final: bool):
        self.roles, self.final = roles, final

    def save_pretrained(self, folder: str | Path) -> None:
        self.roles.save_hf(Path(folder), self.final)


class GRPOTrainer(RLTrainer):
    """GRPO and its relatives, shaped like TRL's `GRPOTrainer` (see `RLTrainer`)."""

    config_class = GRPOConfig


class PPOTrainer(RLTrainer):
    """PPO with a critic (GAE); `value_model` (a ScalarHeadModel) replaces the default
    critic, which is the policy's initial weights with a zero value head."""

    config_class = PPOConfig


# ---------------------------------------------------------------------------- the driver


def rl_step(trainer: RLTrainer, step: int) -> tuple[dict[str, float], RLBatch]:
    """One RL iteration, read top to bottom; returns its metrics and its training batch."""
    cfg, r = trainer.args, trainer.roles
    timer = StageTimer(step_stages(r.critic is not None))
    n, algo, kl = cfg.rollout.n, cfg.algorithm, cfg.algorithm.kl
    started = time.perf_counter()

    # 1. prompts → n responses each → scores (DAPO: more rounds until groups differ; async: the
    #    batch generated ahead, within max_staleness updates, while the next ones are submitted)
    if trainer.pipeline is not None:
        batch, metrics = collect_async(trainer.pipeline, step, r.reward, n, timer)
    else:
        batch, metrics = collect_rollouts(
            trainer.next_prompts, lambda prompts, rnd: r.rollout.generate(prompts, step_seed(cfg.trainer.seed, step, rnd)),
            r.reward, algo, cfg.data.train_batch_size, n, timer,
        )
    busy_from = time.perf_counter()  # the actor's pool works from here to the update's end
    r.reward.check_step(step, metrics)  # a function that failed on every sample stops the run here
    if algo.mask_truncated_completions:
        batch = mask_truncated(batch)

    # 2. log-probs of the behaviour policy, of the reference; values of the critic
    with timer("old_logprob"):
        batch, logprob_metrics = trainer.old_logprobs(batch)
    with timer("ref"):
        if r.ref is not None:
            batch = batch.replace(ref_logp=r.ref.compute_logprobs(batch))
    if r.critic is not None:
        with timer("values"):
            batch = batch.replace(values=r.critic.compute_values(batch))

    # 3. per-token rewards (− β·KL when it is in the reward) → advantages
    with timer("adv"):
        beta = trainer.kl_ctrl.value
        if kl.in_reward:
            batch, metrics["kl"] = Reward.apply_kl(batch, beta, kl.kind or "k1")
        batch, adv_metrics = compute_advantages(batch, algo, n)

    # 4. updates: critic first, then the actor (not during critic warmup); new weights to the engine,
    #    which gives its GPU memory to the update meanwhile (a colocated vllm engine sleeps)
    rows, epochs = cfg.mini_batch_prompts * n, cfg.actor.ppo_epochs
    seed = step_seed(cfg.trainer.seed, step, UPDATE_SALT)
    r.offload_rollout()
    critic_metrics = {}
    if r.critic is not None:
        with timer("update_critic"):
            critic_metrics = {"value_loss": 0.0, **r.critic.update(batch, rows, epochs, seed)}
    with timer("update_actor"):
        actor_metrics = {}
        if step > cfg.critic.warmup_steps:
            actor_metrics = r.actor.update(batch, rows, epochs, beta, seed)
    busy = (busy_from, time.perf_counter())
    if trainer.pipeline is not None:
        trainer.pipeline.updated()  # the sync is queued behind the generations in flight
    else:
        r.sync_rollout()

    if step == 1 and not cfg.use_critic:
        log.info("policy_loss ≈ 0 on a fresh rollout is expected (ratio 1, advantages centred per group); "
                 "its gradient is not 0. Follow reward/mean and grad_norm (see posttrain.trainers.rl)")
    out = {**NOT_RUN, **metrics, **logprob_metrics, **adv_metrics, **_prefixed(critic_metrics, "critic/"),
           **actor_metrics}
    trainer.kl_ctrl.update(out["kl"], len(batch))
    elapsed = time.perf_counter() - started
    if trainer.pipeline is not None:
        out.update(lane_metrics(trainer.pipeline.lane, started, started + elapsed, busy))
    if kl.enabled:  # β only acts through a KL term (`config.algorithm.KLConfig`)
        out["kl_coef"] = beta
    out.update(timer.metrics(), **{
        "lr": actor_metrics["lr"] if "lr" in actor_metrics else r.actor.lr(),
        "timing/step": elapsed,
        "throughput/tokens_per_s": batch.num_tokens() / max(elapsed, 1e-9),
    })
    return out, batch


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """grad_norm, lr, … of the critic under critic/ (value_loss, a DESIGN.md name, and
    names already under a section stay as they are)."""
    return {k if k == "value_loss" or "/" in k else prefix + k: v for k, v in metrics.items()}


# ---------------------------------------------------------------------------- CLI entry points


def run_rl(cfg: RLConfig) -> FitResult:
    """`posttrain grpo` / `posttrain ppo`: train as configured."""
    check(bool(cfg.data.train_files), "data.train_files", "no training data: set data.train_files=[path.jsonl]")
    check(cfg.model.path is not None or cfg.model.init is not None, "model.path",
          "set model.path (a local HF model directory, e.g. an SFT run's final/) or model.init (tiny|small)")
    trainer_cls = PPOTrainer if isinstance(cfg, PPOConfig) else GRPOTrainer
    result = trainer_cls(args=cfg).train()
    print(f"model: {result.final_dir}\nmetrics: {result.run_dir / 'metrics.jsonl'}")
    return result

