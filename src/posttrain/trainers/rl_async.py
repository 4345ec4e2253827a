"""Asynchronous RL (trainer.async_training, docs/async.md): the rollout runs up to K batches
ahead of the update.

    step s:  fill: submit the generation of step s+K's prompts (weights: version s-1)
             take: wait for step s's batch (generated with version ≥ s-1-K)
             ... reward, old/ref log-probs, values, advantages, update (version s) ...
             updated: submit the weight sync (rollout ← actor) behind the generations in flight

Jobs run one after another in submission order on a `Lane`: a thread of its own when the
rollout has a Ray pool of its own (the generation then runs in the rollout workers while the
actor workers train: the overlap), else at once in the caller. The order is the same, so is
every number: each generation sees exactly the weights synced before it was submitted.

The version of a batch is the number of updates behind the weights that generated it; its
staleness at step s is (s - 1) - version, in [0, K] (the lane never starts a batch over the
bound: veRL's `wait`; `drop` discards a group found over it and generates that many fresh
prompts in its place).

Partial rollouts (`partial`, `rl_partial`): a batch is generated in segments, and a weight sync
reaches a generation in flight at a segment boundary. On a thread (a pool of its own) a batch's
job runs all its segments, applying the newest sync waiting (`pending`) before each: the sync
goes ahead of the remaining segments, at the first boundary after the update ends (so where it
lands depends on timing). In turn, at a fixed point: a batch's first segment is generated when
it is submitted, the rest when its step takes it, after the syncs of the updates between.

Resume: a checkpoint records the prompts in flight (`state`); the restored run regenerates them
with the restored weights, in their order, so every prompt of the stream is trained on once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.algos import masked_mean
from posttrain.logging import get_logger
from posttrain.trainers.rl_partial import InPlay, PartialEpisodes, PartialRollout, Segments
from posttrain.trainers.rl_steps import generation_metrics
from posttrain.workers import RLBatch

log = get_logger(__name__)


class Lane:
    """Runs jobs in submission order, each timed (`busy`: (start, end) of every job run;
    `running`: the start of the job running now, None between jobs): in one thread of its own
    (`threaded`), or at once in the caller, whose returned future is then already done."""

    def __init__(self, threaded: bool):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-lane") if threaded else None
        self.busy: list[tuple[float, float]] = []
        self.running: float | None = None
        self.lock = threading.Lock()  # `busy` and `running` are written by the lane's thread

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        def timed() -> Any:
            t0 = time.perf_counter()
            with self.lock:
                self.running = t0
            try:
                return fn(*args)
            finally:
                with self.lock:
                    self.busy.append((t0, time.perf_counter()))
                    self.running = None

        if self.pool is not None:
            return self.pool.submit(timed)
        future: Future = Future()
        try:
            future.set_result(timed())
        except BaseException as err:  # raised where the result is read, as from the thread
            future.set_exception(err)
        return future

    def drain(self) -> None:
        """Wait until every job submitted so far has run (their results stay in their futures)."""
        if self.pool is not None:
            self.pool.submit(lambda: None).result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class InFlight:
    """A batch submitted to the lane."""

    step: int
    """The step that trains on it (its generation seed is that step's, as in the synchronous loop)."""
    prompts: RLBatch
    """Its prompts, with `uid` and `prompt_index`."""
    version: int
    """Updates behind the weights that generate it (partial rollouts: that start it)."""
    future: Future
    """Its RLBatch; partial rollouts: its `rl_partial.Segments` (in turn: the first segment only)."""


def overlap(busy: list[tuple[float, float]], start: float, end: float, other: tuple[float, float]) -> float:
    """Seconds within [start, end] in which a job of `busy` ran while `other` (an interval) did."""
    lo, hi = max(start, other[0]), min(end, other[1])
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in busy) if hi > lo else 0.0


def stale_groups(versions: torch.Tensor, mask: torch.Tensor, version: int, k: int, n: int) -> torch.Tensor:
    """(B/n,) bool: the groups (n contiguous rows) holding a trained token generated more than
    `k` updates before `version`. versions, mask: (B, Tr)."""
    oldest = torch.where(mask.bool(), versions, torch.full_like(versions, version)).amin(-1)  # (B,)
    return (version - oldest > k).view(-1, n).any(-1)


def staleness_metrics(versions: torch.Tensor, mask: torch.Tensor, version: int) -> dict[str, float]:
    """async/staleness/mean and /max over the trained tokens (mask), in updates, each token as
    stale as its sample's oldest trained token (partial rollouts: the sample's tokens can be of
    several versions): stale[b, t] = version - min_t'{versions[b, t'] : mask[b, t']}.
    versions, mask: (B, Tr)."""
    m = mask.bool()
    if not m.any():
        return {"async/staleness/mean": 0.0, "async/staleness/max": 0.0}
    oldest = torch.where(m, versions, torch.full_like(versions, version)).amin(-1, keepdim=True)  # (B, 1)
    stale = (version - oldest).expand_as(versions).to(torch.float64)
    return {"async/staleness/mean": float(masked_mean(stale, mask)), "async/staleness/max": float(stale[m].max())}


class AsyncRollouts:
    """The batches in flight (module docstring). `draw(count)`: the next `count` prompts of the
    stream (with uid and prompt_index); `generate(prompts, step)`: their responses with the
    rollout's weights (the step's seed); `sync()`: the rollout takes the actor's newest weights
    (returns a callable the lane runs, so the weights are read when the update is done)."""

    def __init__(self, k: int, policy: str, n: int, lane: Lane, draw: Callable[[int | None], RLBatch],
                 generate: Callable[[RLBatch, int], RLBatch], sync: Callable[[], Callable[[], None]],
                 partial: PartialRollout | PartialEpisodes | None = None):
        self.k, self.policy, self.n, self.lane = k, policy, n, lane
        self.draw, self.generate, self.sync, self.partial = draw, generate, sync, partial
        self.jobs: deque[InFlight] = deque()
        self.version = 0
        self.restored: list[tuple[int, RLBatch]] = []  # in flight at the checkpoint: regenerated first
        # partial rollouts: the newest sync not yet applied (sync, its version), and the version of
        # the weights the engines hold (read and written by the lane's jobs)
        self.pending: tuple[Callable[[], None], int] | None = None
        self.engine_version = 0

    def _submit(self, step: int, prompts: RLBatch) -> None:
        job = self.lane.submit(self.generate, prompts, step) if self.partial is None else \
            self.lane.submit(self._segments, prompts, step)
        self.jobs.append(InFlight(step, prompts, self.version, job))

    def _apply_pending(self) -> None:
        """Partial rollouts: the engines take the newest weights synced, if any are waiting."""
        with self.lane.lock:
            pending, self.pending = self.pending, None
        if pending is not None:
            pending[0]()
            self.engine_version = pending[1]

    def _segments(self, prompts: RLBatch, step: int) -> Segments | InPlay:
        """A lane job (partial rollouts): in turn the batch's first segment; on a thread all of
        them, each after the newest sync waiting."""
        self._apply_pending()
        part = self.partial.start(prompts, step, self.engine_version)
        while self.lane.pool is not None and not part.finished:
            part = self._next_segment(part)
        return part

    def _next_segment(self, part: Segments | InPlay) -> Segments | InPlay:
        self._apply_pending()
        return self.partial.resume(part, self.engine_version)

    def _finish(self, part: Segments | InPlay) -> Segments | InPlay:
        """A lane job (partial rollouts in turn): the remaining segments, with the weights now."""
        while not part.finished:
            part = self._next_segment(part)
        return part

    def fill(self, step: int) -> None:
        """Submit the batches of steps up to step + K (the restored ones first)."""
        for s, prompts in self.restored:
            self._submit(s, prompts)
        self.restored = []
        nxt = self.jobs[-1].step + 1 if self.jobs else step
        while nxt <= step + self.k:
            self._submit(nxt, self.draw(None))
            nxt += 1

    def take(self, step: int) -> RLBatch:
        """Step `step`'s batch (waiting for it; partial rollouts in turn: generating the rest of
        it), each token's version in `versions`."""
        job = self.jobs.popleft()
        assert job.step == step, f"the pipeline holds step {job.step}'s batch at step {step}"
        batch = job.future.result()
        if self.partial is None:
            return batch.replace(versions=torch.full_like(batch.response_ids, job.version))
        if not batch.finished:  # in turn: the rest of it now
            batch = self.lane.submit(self._finish, batch).result()
        return self.partial.complete(batch)

    def enforce_bound(self, batch: RLBatch, step: int) -> tuple[RLBatch, int]:
        """`drop`: the groups over the bound replaced by as many fresh prompts' groups, generated
        with the current weights: on the rollout's lane, after every sync queued before (on a
        pool of its own a refill on the driver's thread could run before them). stale_policy=wait
        never starts one: nothing to do. Returns the batch and the count of groups dropped."""
        if self.policy != "drop":
            return batch, 0
        stale = stale_groups(batch.versions, batch.response_mask, self.version, self.k, self.n)
        dropped = int(stale.sum())
        if not dropped:
            return batch, 0
        kept = batch.select((~stale).repeat_interleave(self.n))
        prompts = self.draw(dropped)
        if self.partial is None:  # on the lane, after the syncs queued: the weights of self.version
            fresh = self.lane.submit(self.generate, prompts, step).result()
            fresh = fresh.replace(versions=torch.full_like(fresh.response_ids, self.version))
        else:  # on the lane, after the syncs waiting: each token's version is the weights' it had
            fresh = self.partial.complete(self.lane.submit(lambda: self._finish(self._segments(prompts, step))).result())
        log.info("step %d: %d prompt groups over trainer.async_training.max_staleness=%d dropped and refilled",
                 step, dropped, self.k)
        return RLBatch.concat([kept, fresh]), dropped

    def updated(self) -> None:
        """After the step's update: one version more, and the weight sync queued behind the
        generations in flight (partial rollouts: ahead of their remaining segments; a newer sync
        replaces one still waiting)."""
        self.version += 1
        if self.partial is None:
            self.lane.submit(self.sync())
            return
        sync = self.sync()  # outside the lock: on Ray it asks the actor for its weights
        with self.lane.lock:  # partial rollouts: a generation in flight applies it at its next boundary
            self.pending = (sync, self.version)
        self.lane.submit(self._apply_pending)

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> list[dict[str, Any]]:
        """The prompts in flight: for each batch, its step, uids and prompt indices."""
        jobs = [(j.step, j.prompts) for j in self.jobs] + self.restored
        return [{"step": s, "uid": p.uid.tolist(), "prompt_index": p.prompt_index.tolist()} for s, p in jobs]

    def load_state(self, state: list[dict[str, Any]], version: int, prompts_of: Callable[[list[int]], RLBatch]) -> None:
        """Forget what is in flight; the checkpoint's in-flight prompts (`state`) are regenerated
        by the next `fill` with the restored weights (`version`)."""
        self.lane.drain()
        self.jobs.clear()
        if self.partial is not None:
            self.partial.forget()
        self.version = self.engine_version = version
        self.pending = None
        self.restored = [(j["step"], prompts_of(j["prompt_index"]).replace(uid=torch.tensor(j["uid"])))
                         for j in state]


# ----------------------------------------------------------------------------- the driver's stages


def collect_async(pipe: AsyncRollouts, step: int, reward: Any, n: int, timer: Any) -> tuple[RLBatch, dict[str, float]]:
    """Step 1 of the driver in async RL: submit the batches up to step + K, take this step's
    (timing/gen: the wait for it), keep it within the bound, score it. The metrics are the
    synchronous loop's (one generation round) plus async/staleness/*, async/dropped_groups and
    timing/wait_rollout."""
    t0 = time.perf_counter()
    with timer("gen"):
        pipe.fill(step)  # in turn (no pool of its own): the generation runs here
        batch = pipe.take(step)
        waited = time.perf_counter() - t0
        batch, dropped = pipe.enforce_bound(batch, step)
    with timer("reward"):
        batch, reward_metrics = reward.score(batch)
    metrics = generation_metrics([batch], [reward_metrics], n)
    metrics.update({"dynamic_sampling/gen_batches": 1.0, "dynamic_sampling/kept_frac": 1.0,
                    "async/dropped_groups": float(dropped), "timing/wait_rollout": waited,
                    **staleness_metrics(batch.versions, batch.response_mask, pipe.version)})
    return batch, metrics


def lane_metrics(lane: Lane, start: float, end: float, update: tuple[float, float]) -> dict[str, float]:
    """timing/wait_update: seconds of the step [start, end] in which the rollout had no job (it
    waited on the update); perf/overlap: the share of the step in which it ran a job while the
    actor's pool was busy (`update`: from the batch's arrival to the update's end). A job still
    running at `end` counts as busy up to it (a generation longer than the update runs across
    steps); the lane's older jobs are forgotten."""
    with lane.lock:
        busy = lane.busy + ([(lane.running, end)] if lane.running is not None else [])
        lane.busy = [(a, b) for a, b in lane.busy if b > end]
    gen = overlap(busy, start, end, (start, end))
    both = overlap(busy, start, end, update)
    span = max(end - start, 1e-9)
    return {"timing/wait_update": max(0.0, span - gen), "perf/overlap": both / span}
