"""trainer.async_training: generation and update overlapped, with bounded staleness (docs/async.md).

(`async` is a Python keyword, so the section cannot be `trainer.async`; veRL's fully async
recipe names its section async_training too.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.config.aliases import aliases, trl, verl
from posttrain.config.core import check


@dataclass
class AsyncConfig:
    """Asynchronous RL: the rollout generates the batches of later steps while the actor trains
    on the current one, with stale weights at most `max_staleness` updates old."""

    max_staleness: int = field(default=0, metadata=aliases(
        verl("trainer.v1.sampler.max_off_policy_threshold",
             note="veRL's default is 8, ours 0 (synchronous)"),
        trl("max_staleness", note="TRL's AsyncGRPOTrainer (experimental); its default is 4, ours 0 (synchronous)")))
    """K: no sample is trained on whose oldest token was generated more than K policy updates
    before the update that trains on it. 0: the synchronous loop (generate, then update; the
    same numbers as before this option existed). K >= 1: the rollout runs up to K batches ahead
    of the update, the behaviour log-probs are recorded (rollout.calculate_log_probs) and the
    loss is decoupled PPO (AReaL): the ratio π_θ / π_prox (π_prox: the old log-probs the actor
    recomputes) times the behaviour weight π_prox / π_behaviour, truncated or masked as
    algorithm.rollout_correction.* says (rollout_is=token, TIS at rollout_is_threshold, when
    it is null). The overlap is real where the rollout has a Ray pool of its own
    (placement.rollout.enable_resource_pool=true); elsewhere the same schedule runs in turn
    (the same numbers, no speed-up)."""
    mode: Literal["fully_async", "one_step_off"] = "fully_async"
    """`one_step_off` (veRL's one_step_off_policy, needs max_staleness=1): the batch of step t+1
    is generated while step t's update runs, and the weights are synced after every update.
    `fully_async`: the rollout keeps up to max_staleness batches in flight, each started with
    the newest weights synced (SkyRL's admission control); with max_staleness=1 this is the
    one-step-off schedule. veRL's fully async also syncs every trigger_parameter_sync_step
    updates: not here (partial_rollout is)."""
    stale_policy: Literal["wait", "drop"] = field(default="wait", metadata=aliases(
        verl("trainer.v1.sampler.max_off_policy_strategy")))
    """What happens to a prompt group over the bound at the step that would train on it
    (veRL's names). `wait`: the rollout is held back (it starts a batch only within the bound).
    `drop`: the group is discarded (async/dropped_groups counts it) and exactly that many fresh
    prompts are generated with the current weights in its place. This schedule starts every
    batch within the bound, so on an uninterrupted run `drop` finds nothing to drop; it guards
    the groups of a batch whose weights lag behind the schedule."""

    partial_rollout: bool = field(default=False, metadata=aliases(verl("async_training.partial_rollout")))
    """Partial rollouts (veRL's fully async, AReaL): the rollout generates a batch in segments of
    partial_rollout_tokens new tokens, and a weight sync reaches it at the next segment boundary:
    the unfinished responses keep their tokens, behaviour log-probs and each token's version, and
    go on under the new weights (one response can hold tokens of several versions; the bound and
    async/staleness/* count a response's oldest token). On a rollout pool of its own the sync
    lands at the first boundary after the update ends; in turn, at a fixed point: every batch's
    first segment is generated when it is submitted, the rest when its step takes it. Multi-turn
    episodes (rollout.env / rollout.tools) stay on the rollout workers with their environments
    between segments, and a sync lands mid-turn or between turns. Needs max_staleness >= 1 and the
    native or hf engine (vllm cannot resume a row's random stream); single-turn responses take no
    rollout.stop strings (a string split over two segments would be missed: use
    rollout.stop_token_ids). Each segment prefills prompt + tokens so far again."""
    partial_rollout_tokens: int = 64
    """With partial_rollout: the new tokens per row of one segment (the granularity at which a
    weight sync reaches a generation; episodes: model tokens, the environment's not counted).
    rollout.max_new_tokens in segments of this many."""

    def validate(self) -> None:
        k = self.max_staleness
        check(k >= 0, "trainer.async_training.max_staleness", f"must be >= 0, got {k}")
        check(self.mode != "one_step_off" or k == 1, "trainer.async_training.mode",
              f"one_step_off overlaps the next step's generation with this step's update: it needs "
              f"trainer.async_training.max_staleness=1, got {k} (or mode=fully_async for K={k})")
        check(self.partial_rollout_tokens >= 1, "trainer.async_training.partial_rollout_tokens",
              f"must be >= 1, got {self.partial_rollout_tokens}")
        check(not self.partial_rollout or k >= 1, "trainer.async_training.partial_rollout",
              "partial rollouts let a weight update reach a generation in flight, and the synchronous loop "
              "(max_staleness=0) has none: set trainer.async_training.max_staleness >= 1")

    @property
    def enabled(self) -> bool:
        return self.max_staleness > 0
