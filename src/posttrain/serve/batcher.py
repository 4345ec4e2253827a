"""Batching: concurrent requests share one `engine.generate` call, made by one thread.

Request handlers `submit` a job (token-id prompts + SamplingParams) and get a Future of
its `Generated` (the server awaits it on its event loop, so waiting costs no thread). The
generation thread takes the oldest waiting job, waits until `batch_wait_ms` after that
job arrived or until the waiting jobs hold `max_batch_size` rows (prompts x n), takes
jobs in arrival order while they fit in `max_batch_size` rows (always at least one, so a
request larger than the limit runs alone), and groups them:

- jobs whose SamplingParams are equal apart from `n` share one call: each prompt is
  repeated n times and the call samples once per row (params.n = 1); the rows are handed
  back to their jobs in order. Greedy requests ignore `seed`, so they group regardless of it.
- a sampled job with a `seed` runs alone with its own params, so the same request with
  the same seed gets the same completions however many others arrive with it (the
  engines' noise depends on the rows of the call).
- jobs with different params (temperature, max_tokens, stop, ...) run as separate calls,
  one after another, in the order their first job arrived.

A job that asks for log-probs (`top_logprobs`) gets them from one scoring forward of its
rows after the call (`serve.logprobs`), on the same thread; it shares the call with others.

A job submitted with `on_tokens` hears its rows' new tokens after every decode step of
its call (rows numbered within the job, as its results), so the server can stream them
while the call runs; a call passes `on_tokens` to the engine only when one of its jobs
has one.

Jobs not taken wait for the next round, whose wait is again counted from the arrival of
its oldest job. `stats()` counts requests, generate calls and their sizes (shown by the
server's /health), so batching is observable.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from posttrain.rollout import RolloutEngine, SamplingParams, TokenCallback
from posttrain.serve.logprobs import TokenLogprobs, score

log = logging.getLogger(__name__)


class BatcherClosed(RuntimeError):
    """The batcher stopped before (or while) a job was run."""


@dataclass
class Generated:
    """One job's results, N = prompts x n rows grouped by prompt."""

    texts: list[str]
    finish_reasons: list[str]
    lengths: list[int]
    """Generated tokens per row (the stop token included)."""
    logprobs: list[TokenLogprobs] | None = None
    """Per row its tokens' log-probs and the top k (`serve.logprobs.score`), when the job
    asked for them (`top_logprobs` not None)."""


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    on_tokens: TokenCallback | None = None
    top_logprobs: int | None = None  # None: no log-probs; k: each token's and the k most likely
    arrived: float = field(default_factory=time.monotonic)
    future: Future[Generated] = field(default_factory=Future)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n


def batch_key(params: SamplingParams) -> SamplingParams | None:
    """The params of the shared call a job may join (n = 1, no seed), or None: run alone."""
    if params.seed is not None and not params.greedy:
        return None
    return dataclasses.replace(params, n=1, seed=None)


class Batcher:
    """Gathers jobs for up to `batch_wait_ms` and runs them through `engine` (module docstring)."""

    def __init__(
        self, engine: RolloutEngine, max_batch_size: int = 32, batch_wait_ms: float = 10.0
    ):
        if max_batch_size < 1 or batch_wait_ms < 0:
            raise ValueError(
                f"need max_batch_size >= 1 and batch_wait_ms >= 0, got {max_batch_size}, {batch_wait_ms}"
            )
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._pending: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._stats: Counter[str] = Counter()
        self._requests_per_call: Counter[int] = Counter()
        self._thread = threading.Thread(target=self._loop, name="posttrain-generate", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_tokens: TokenCallback | None = None,
        top_logprobs: int | None = None,
    ) -> Future[Generated]:
        """Queue one request's prompts x params.n samples; `on_tokens(rows, token_ids)` hears
        them as they are decoded (on the generation thread); `top_logprobs` k (not None) adds
        the tokens' log-probs and the k most likely at each (`Generated.logprobs`). The future
        fails with BatcherClosed when the batcher is (or gets) closed first, or with the
        engine's error."""
        job = _Job(prompts, params, on_tokens, top_logprobs)
        with self._cond:
            if self._closed:
                job.future.set_exception(BatcherClosed("the server is shutting down"))
            else:
                self._pending.append(job)
                self._cond.notify()
        return job.future

    def stats(self) -> dict:
        """Counters since start: requests, generate_calls, rows, max_batch_rows,
        requests_per_call ({requests in a call: how many calls}), pending."""
        with self._cond:
            return {
                **{
                    k: self._stats[k]
                    for k in ("requests", "generate_calls", "rows", "max_batch_rows")
                },
                "requests_per_call": {
                    str(k): v for k, v in sorted(self._requests_per_call.items())
                },
                "pending": len(self._pending),
            }

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop after the call in progress; waiting jobs fail with BatcherClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- the generation thread ---------------------------------------------------------

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            groups: dict[object, list[_Job]] = {}
            for job in jobs:
                key = batch_key(job.params)
                groups.setdefault(key if key is not None else id(job), []).append(job)
            for group in groups.values():
                self._run(group)

    def _take(self) -> list[_Job] | None:
        """The next round's jobs (see the module docstring); None once closed."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            while not self._closed:
                waiting = sum(j.rows for j in self._pending)
                left = self._pending[0].arrived + self.batch_wait_s - time.monotonic()
                if waiting >= self.max_batch_size or left <= 0:
                    break
                self._cond.wait(left)
            if self._closed:
                for job in self._pending:
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(BatcherClosed("the server is shutting down"))
                self._pending.clear()
                return None
            jobs = [self._pending.popleft()]
            rows = jobs[0].rows
            while self._pending and rows + self._pending[0].rows <= self.max_batch_size:
                rows += self._pending[0].rows
                jobs.append(self._pending.popleft())
        # A request cancelled while it waited (its client gone at shutdown) is not generated.
        return [j for j in jobs if j.future.set_running_or_notify_cancel()]

    def _run(self, jobs: list[_Job]) -> None:
        """One engine call for jobs that share their batch key; results or the error to each."""
        alone = batch_key(jobs[0].params) is None
        params = jobs[0].params if alone else batch_key(jobs[0].params)
        rows = (
            jobs[0].prompts
            if alone
            else [p for j in jobs for p in j.prompts for _ in range(j.params.n)]
        )
        try:
            if any(j.on_tokens is not None for j in jobs):
                out = self.engine.generate(rows, params, on_tokens=_dispatch(jobs))
            else:
                out = self.engine.generate(rows, params)
        except Exception as err:
            log.exception("generation failed for %d request(s)", len(jobs))
            for job in jobs:
                job.future.set_exception(err)
            return
        lengths = out.lengths.tolist()
        with self._cond:  # counted before anyone is answered, so /health is never behind
            self._stats.update(requests=len(jobs), generate_calls=1, rows=len(lengths))
            self._stats["max_batch_rows"] = max(self._stats["max_batch_rows"], len(lengths))
            self._requests_per_call[len(jobs)] += 1
        start = 0
        for job in jobs:
            end = start + job.rows
            result = Generated(out.texts[start:end], out.finish_reason[start:end], lengths[start:end])
            try:
                if job.top_logprobs is not None:  # on this thread: the model is never run by two
                    ids = [out.response_ids[r, : lengths[r]].tolist() for r in range(start, end)]
                    prompts = [p for p in job.prompts for _ in range(job.params.n)]
                    result.logprobs = score(self.engine.model, prompts, ids, job.top_logprobs)
            except Exception as err:
                log.exception("scoring the log-probs of a request failed")
                job.future.set_exception(err)
            else:
                job.future.set_result(result)
            start = end


def _dispatch(jobs: list[_Job]) -> TokenCallback:
    """The call's `on_tokens`: each row's token to its job, rows renumbered within the job.
    A failing job callback is logged and does not stop the call."""
    owner: list[_Job] = [j for j in jobs for _ in range(j.rows)]
    local: list[int] = [r for j in jobs for r in range(j.rows)]

    def on_tokens(rows: list[int], tokens: list[int]) -> None:
        per_job: dict[int, tuple[_Job, list[int], list[int]]] = {}
        for row, tok in zip(rows, tokens):
            job = owner[row]
            if job.on_tokens is not None:
                entry = per_job.setdefault(id(job), (job, [], []))
                entry[1].append(local[row])
                entry[2].append(tok)
        for job, job_rows, job_tokens in per_job.values():
            try:
                job.on_tokens(job_rows, job_tokens)
            except Exception:
                log.exception("a streaming callback failed")

    return on_tokens
