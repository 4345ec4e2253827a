"""Run several reward functions on a batch: concurrently, under a timeout, never crashing.

    runner = RewardRunner([("math_accuracy", math_accuracy), ("format", format_reward())],
                          weights=[1.0, 0.2], timeout_s=10.0)
    result = runner.score(prompts, completions, completion_ids, {"answer": answers})
    result.total            # (B,) float32: Σ_f weight_f · reward_f, None terms left out
    result.per_function     # {"math_accuracy": [1.0, 0.0, None, ...], ...}
    result.metrics          # {"reward/mean": ..., "reward/math_accuracy/errors": 0, ...}

A reward function has TRL's signature, `fn(prompts, completions, completion_ids, **columns)
-> list[float | None]`, called with keyword arguments only; every dataset column arrives as a
list aligned with `completions`. A function that names them or takes **kwargs also gets TRL's
run arguments (`RUN_KWARGS`):
  - `trainer_state`: the run's state (`posttrain.trainers.callbacks.TrainerState`: global_step,
    the steps done before this one, epoch, max_steps, ...), set by the trainer (`trainer_state`
    attribute); None outside a training run (`posttrain eval`);
  - `log_metric(name, value)`: a figure of the function's own, logged as `reward/<fn>/<name>`,
    the mean of the values logged while the step's batch was scored.

What the runner does with what a function gives back (the semantics, in one place):
  - None means "not applicable": the sample is left out of that function's mean/std and adds
    nothing to the weighted total. A sample for which every function says None gets total 0
    and still counts in `reward/mean` (as TRL's nansum does).
  - NaN is read as None (TRL itself turns None into NaN), counted in `reward/<fn>/nan`; the
    first NaN of each function logs a warning, as a NaN is more often a bug than a choice.
  - An exception raised by the call, a call still running after `timeout_s`, a list of the
    wrong length, or an element that is not a finite number (a string, ±inf, ...) gives the
    affected samples `failure_reward` and counts them in `reward/<fn>/errors`. The first
    `MAX_LOGGED_ERRORS` errors of each function are logged with their traceback; the first
    is kept (`first_failure`) for the error that stops a run whose function always fails
    (`posttrain.rewards.checks.RewardFailureGuard`).
  - A function may put an `Exception` instance in place of one element: that sample alone
    fails, exactly as if a per-sample call had raised (the LLM judge does this for a
    request that failed after its retries).

Granularity: one call per function for the whole batch, all functions at once, each in its
own thread. If the batched call raises, the function is called again once per sample (at
most `max_workers` threads at a time, under a fresh `timeout_s`), so only the samples that
really fail get the failure reward; a batch therefore takes at most 2 × `timeout_s`. A batch
call that times out fails the whole batch: retrying it sample by sample would double the
wait and leave more threads hung. So a function is called from several threads at once
(the retries), and different functions run side by side: a function with shared mutable
state must guard it with a lock.

Timeouts and threads: Python cannot kill a thread. A call that overruns is abandoned: it runs
in a daemon thread, so it never blocks the process from exiting, its result is thrown away,
and `reward/hung_threads` counts the abandoned threads still alive. A function that hangs in
pure-Python CPU work keeps one core (and a share of the GIL) busy until it returns; work that
can hang for good (generated code) belongs in a subprocess, as `code_tests` does through
`posttrain.rewards.sandbox`. Threads are the default because reward functions are often
closures that share caches (tokenizers, judges' connection settings) with the trainer
process. A `sys.exit` in a function is a raise like any other (SystemExit is caught).

Isolation (`isolation="process"`, config `reward.isolation`): every call of a function runs in
a worker process (`posttrain.rewards.isolation`), still waited for by a thread here, so the
timeouts, retries and accounting above are unchanged; in addition a function that ends its
process (`os._exit`, a segfault) or hangs is counted as a failure, the worker is killed and
a fresh one takes its place.

Metrics (TRL logs `reward`, `reward_std`, `rewards/<fn>/mean|std`; the meaning is the same):
  reward/mean, reward/std            over the weighted totals of the batch
  reward/<fn>/mean, reward/<fn>/std  over the samples where fn gave a value (failure rewards
                                     included); NaN when it gave none
  reward/<fn>/errors                 samples that got the failure reward
  reward/<fn>/none_frac              fraction of samples where fn said None (or NaN)
  reward/<fn>/nan                    samples where fn returned NaN
  reward/<fn>/time_s                 wall time of the function's batch call
  reward/<fn>/<key>                  whatever `fn.pop_metrics()` returns, if fn has it, and the
                                     mean of what fn gave `log_metric(key, value)` on this batch
  reward/hung_threads                abandoned calls still running
Standard deviations are Bessel-corrected, as TRL's `nanstd`, and 0.0 for fewer than two values.
`tallies` add up samples, errors and NaNs over every batch scored; `summary()` says them.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.rewards.base import RUN_KWARGS, map_in_daemon_threads
from posttrain.rewards.isolation import WorkerPool, WorkerTimedOut, in_worker
from posttrain.user_code import raised

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[Any]]
MAX_LOGGED_ERRORS = 3


def run_kwargs_of(fn: RewardFn) -> tuple[str, ...]:
    """The `RUN_KWARGS` that `fn` accepts (named, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return RUN_KWARGS
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return tuple(k for k in RUN_KWARGS if k in names)


class MetricLog:
    """`log_metric(name, value)` of one function for one batch: the values, averaged by `means`.
    Thread-safe (the per-sample retries call the function from several threads)."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, value: float) -> None:
        with self._lock:
            self._values.setdefault(str(name), []).append(float(value))

    def means(self) -> dict[str, float]:
        with self._lock:
            return {k: sum(v) / len(v) for k, v in self._values.items()}


@dataclass
class Tally:
    """One function's counts over every batch a runner scored."""

    samples: int = 0
    errors: int = 0  # samples that got the failure reward
    nan: int = 0  # samples where the function returned NaN

    def describe(self, name: str) -> str:
        rate = self.errors / self.samples if self.samples else 0.0
        return f"{name}: {self.errors} of {self.samples} samples failed ({rate:.1%}), {self.nan} NaN"


@dataclass
class RewardResult:
    """Rewards of one batch of B completions."""

    total: torch.Tensor  # (B,) float32: Σ_f weight_f · reward_f over the fns that gave a value
    per_function: dict[str, list[float | None]]  # name -> B values; failures hold failure_reward
    metrics: dict[str, float] = field(default_factory=dict)  # see the module docstring


class _Call:
    """One call of a reward function in a daemon thread; `done` is set when it returns or raises."""

    def __init__(self, fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(fn, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
        start = time.monotonic()
        try:
            self.value = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - a reward function must never kill the run
            self.error = e
        finally:
            self.seconds = time.monotonic() - start
            self.done.set()


class RewardRunner:
    """Calls reward functions on a batch and combines them into one weighted reward.

    Args:
        functions: (name, fn) pairs; names must be unique (they key the metrics).
            `RewardRunner.from_specs` builds them from names, option dicts or import paths.
        weights: one weight per function (TRL's `reward_weights`); None gives all 1.0.
        timeout_s: how long a batch call may run; per-sample retries get as long again.
        failure_reward: the value of a sample whose reward call failed, before weighting.
        max_workers: threads per function for the per-sample retries after a batch call raised.
        isolation: "thread" (functions run in the trainer's process) or "process" (each call
            of a user's function in a worker process, `posttrain.rewards.isolation`; the
            built-ins stay here); `close()` ends the workers.
    """

    def __init__(
        self,
        functions: Sequence[tuple[str, RewardFn]],
        weights: Sequence[float] | None = None,
        timeout_s: float = 10.0,
        failure_reward: float = 0.0,
        max_workers: int = 8,
        isolation: str = "thread",
    ) -> None:
        names = [name for name, _ in functions]
        if not names:
            raise ValueError("RewardRunner needs at least one reward function")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward function names must be unique, repeated: {dupes}")
        for name, fn in functions:
            if not callable(fn):
                raise TypeError(f"reward function {name!r} is not callable: {fn!r}")
        weights = [1.0] * len(names) if weights is None else [float(w) for w in weights]
        if len(weights) != len(names):
            raise ValueError(
                f"{len(weights)} reward weights for {len(names)} reward functions {names}"
            )
        if not timeout_s > 0 or max_workers < 1:
            raise ValueError(
                f"need timeout_s > 0 and max_workers >= 1, got {timeout_s}, {max_workers}"
            )
        if not math.isfinite(failure_reward):
            raise ValueError(f"failure_reward must be finite, got {failure_reward}")
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        self.pool = WorkerPool() if isolation == "process" else None
        self._original = dict(functions)
        self.functions = [(name, self._isolated(fn, timeout_s)) for name, fn in functions]
        if self.pool is not None:
            self.pool.warm(len(self.pool.payloads))  # one worker per isolated function, ready before the first batch
        self.weights = weights
        self.timeout_s = timeout_s
        self.failure_reward = float(failure_reward)
        self.max_workers = max_workers
        self._logged = dict.fromkeys(names, 0)
        self._hung: list[threading.Thread] = []
        self.tallies = {name: Tally() for name in names}
        self._first_failure: dict[str, str] = {}
        self._run_kwargs = {name: run_kwargs_of(fn) for name, fn in self.functions}
        self.trainer_state: Any = None
        """TRL's `trainer_state` reward argument: the trainer sets it to its `TrainerState`."""

    def _isolated(self, fn: RewardFn, timeout_s: float) -> RewardFn:
        """`fn` as the runner calls it: in a worker process under isolation=process, unless it
        is posttrain's own (a built-in)."""
        if self.pool is None or _is_posttrains(fn):
            return fn
        try:
            return in_worker(fn, self.pool, timeout_s)
        except ValueError:
            self.close()
            raise

    def close(self) -> None:
        """End the worker processes (isolation=process); a no-op otherwise."""
        if self.pool is not None:
            self.pool.close()

    def first_failure(self, name: str) -> str | None:
        """What went wrong the first time `name` failed a sample, or None: the exception's
        class, message and the line of the function's code that raised it
        (`user_code.raised`), then its traceback."""
        return self._first_failure.get(name)

    def summary(self) -> str:
        """The error and NaN counts of every function over the batches scored so far."""
        return "; ".join(t.describe(name) for name, t in self.tallies.items())

    @classmethod
    def from_specs(cls, specs: Sequence[Any], **kwargs: Any) -> RewardRunner:
        """Build from specs `resolve_reward` understands: "math_accuracy", {"name": ...}, "pkg.mod:fn"."""
        from posttrain.rewards.registry import resolve_reward

        return cls([resolve_reward(spec) for spec in specs], **kwargs)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.functions]

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> RewardResult:
        """Rewards of B completions; every column must hold B values (one per completion)."""
        n = len(completions)
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        for key, values in (columns or {}).items():
            if key in kwargs or key in RUN_KWARGS:
                raise ValueError(f"column {key!r} clashes with a reward-function argument")
            kwargs[key] = values
        for key, values in kwargs.items():
            if values is not None and len(values) != n:
                raise ValueError(f"{key} has {len(values)} entries for {n} completions")

        logs = {name: MetricLog() for name in self.names}
        run = {name: self._run_arguments(name, logs[name]) for name in self.names}
        calls = [_Call(fn, {**kwargs, **run[name]}) for name, fn in self.functions]
        deadline = time.monotonic() + self.timeout_s
        for call in calls:
            call.done.wait(max(0.0, deadline - time.monotonic()))

        per_function: dict[str, list[float | None]] = {}
        counts: dict[str, tuple[int, int]] = {}  # name -> (errors, NaNs)
        retry: list[tuple[str, RewardFn]] = []
        for (name, fn), call in zip(self.functions, calls):
            if not call.done.is_set() or isinstance(call.error, WorkerTimedOut):  # the worker's deadline may fire first
                if not call.done.is_set():
                    self._hung.append(call.thread)
                left = ("its worker process is killed" if fn is not self._original[name]
                        else "the call is abandoned in a daemon thread")
                self._fail(name, f"timed out after {self.timeout_s} s on a batch of {n}; {left}", None)
                per_function[name], counts[name] = [self.failure_reward] * n, (n, 0)
            elif call.error is not None:
                self._log(name, f"raised on a batch of {n}; retrying sample by sample", call.error)
                retry.append((name, fn))
            else:
                per_function[name], counts[name] = self._check(name, call.value, n)
        if retry:
            self._retry_per_sample(retry, kwargs, n, per_function, counts, run)

        ordered = {name: per_function[name] for name in self.names}
        times = {
            name: call.seconds if call.done.is_set() else self.timeout_s
            for name, call in zip(self.names, calls)
        }
        result = self._combine(ordered, counts, times)
        for name, log in logs.items():
            result.metrics.update({f"reward/{name}/{k}": v for k, v in log.means().items()})
        return result

    def _run_arguments(self, name: str, log: MetricLog) -> dict[str, Any]:
        """The `RUN_KWARGS` function `name` accepts, with this batch's values."""
        values = {"trainer_state": self.trainer_state, "log_metric": log}
        return {k: values[k] for k in self._run_kwargs[name]}

    def _retry_per_sample(
        self,
        failed: Sequence[tuple[str, RewardFn]],
        kwargs: Mapping[str, Any],
        n: int,
        per_function: dict[str, list[float | None]],
        counts: dict[str, tuple[int, int]],
        run: Mapping[str, Mapping[str, Any]],
    ) -> None:
        """Call each failed function once per sample, all at once, under one fresh timeout
        (`run`: each function's `RUN_KWARGS`, passed whole)."""
        jobs = [(name, fn, i) for name, fn in failed for i in range(n)]

        def one(job: tuple[str, RewardFn, int]) -> Any:
            name, fn, i = job
            out = fn(**{k: (v if v is None else v[i : i + 1]) for k, v in kwargs.items()}, **run[name])
            if isinstance(out, torch.Tensor):
                out = out.reshape(-1).tolist()
            if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != 1:
                raise ValueError(f"returned {_show(out)} for 1 completion (per-sample retry)")
            return out[0]

        values, errs, stragglers = map_in_daemon_threads(
            one, jobs, self.max_workers * len(failed), self.timeout_s
        )
        self._hung.extend(stragglers)
        for k, (name, _) in enumerate(failed):
            raw = [err if err is not None else value
                   for value, err in zip(values[k * n : (k + 1) * n], errs[k * n : (k + 1) * n])]
            rewards, n_errors, n_nan = self._rewards(name, raw, " (per-sample retry)")
            per_function[name], counts[name] = rewards, (n_errors, n_nan)

    def _check(self, name: str, out: Any, n: int) -> tuple[list[float | None], tuple[int, int]]:
        """Validate a batch call's output; bad elements get the failure reward."""
        if isinstance(out, torch.Tensor):
            out = out.tolist() if out.dim() == 1 else out
        try:
            length = len(out)
        except TypeError:
            length = None
        if length != n or isinstance(out, (str, bytes, Mapping)):
            self._fail(
                name,
                f"returned {_show(out)} for {n} completions; expected a list of {n} floats or None",
                None,
            )
            return [self.failure_reward] * n, (n, 0)
        rewards, n_errors, n_nan = self._rewards(name, list(out), "")
        return rewards, (n_errors, n_nan)

    def _rewards(
        self, name: str, raw: Sequence[Any], where: str
    ) -> tuple[list[float | None], int, int]:
        """Raw values (or the exceptions that replaced them) → (rewards, errors, NaNs): a
        failure gets the failure reward, a NaN becomes None."""
        rewards: list[float | None] = []
        n_errors = n_nan = 0
        for i, value in enumerate(raw):
            reward, problem = _to_float(value)
            if problem is not None:
                self._fail(name, f"failed on sample {i}{where}", problem)
                reward, n_errors = self.failure_reward, n_errors + 1
            elif reward is not None and math.isnan(reward):
                if not n_nan and not self.tallies[name].nan:
                    logger.warning(
                        "reward function %r returned NaN on sample %d%s; NaN counts as no reward "
                        "(None) and is counted in reward/%s/nan (this warning is not repeated)",
                        name, i, where, name,
                    )
                reward, n_nan = None, n_nan + 1
            rewards.append(reward)
        return rewards, n_errors, n_nan

    def _combine(
        self,
        per_function: dict[str, list[float | None]],
        counts: dict[str, tuple[int, int]],
        times: dict[str, float],
    ) -> RewardResult:
        n = len(next(iter(per_function.values())))
        total = [0.0] * n
        metrics: dict[str, float] = {}
        for (name, fn), weight in zip(self.functions, self.weights):
            values = per_function[name]
            given = [v for v in values if v is not None]
            for i, v in enumerate(values):
                if v is not None:
                    total[i] += weight * v
            metrics[f"reward/{name}/mean"] = sum(given) / len(given) if given else math.nan
            metrics[f"reward/{name}/std"] = _std(given) if given else math.nan
            errors, nans = counts[name]
            tally = self.tallies[name]
            tally.samples += n
            tally.errors += errors
            tally.nan += nans
            metrics[f"reward/{name}/errors"] = float(errors)
            metrics[f"reward/{name}/nan"] = float(nans)
            metrics[f"reward/{name}/none_frac"] = (n - len(given)) / n if n else 0.0
            metrics[f"reward/{name}/time_s"] = times[name]
            metrics.update(self._extra_metrics(name, fn))
        metrics["reward/mean"] = sum(total) / n if n else math.nan
        metrics["reward/std"] = _std(total)
        self._hung = [t for t in self._hung if t.is_alive()]
        metrics["reward/hung_threads"] = float(len(self._hung))
        return RewardResult(torch.tensor(total, dtype=torch.float32), per_function, metrics)

    def _extra_metrics(self, name: str, fn: RewardFn) -> dict[str, float]:
        pop = getattr(fn, "pop_metrics", None)
        if not callable(pop):
            return {}
        try:
            return {f"reward/{name}/{k}": float(v) for k, v in pop().items()}
        except Exception as e:  # noqa: BLE001 - metrics are never worth a crash
            self._log(name, "pop_metrics() failed", e)
            return {}

    def _fail(self, name: str, what: str, error: BaseException | None) -> None:
        """A sample (or a whole batch) failed: log it, and keep the first of each function."""
        if name not in self._first_failure:
            self._first_failure[name] = f"{what}: {raised(error)}{_traceback(error)}" if error else what
        self._log(name, what, error)

    def _log(self, name: str, what: str, error: BaseException | None) -> None:
        self._logged[name] += 1
        count = self._logged[name]
        if count > MAX_LOGGED_ERRORS:
            return
        detail = _traceback(error)
        more = (
            f" (further errors of {name!r} are only counted in reward/{name}/errors)"
            if count == MAX_LOGGED_ERRORS
            else ""
        )
        logger.warning("reward function %r %s%s%s", name, what, more, detail)


def _is_posttrains(fn: RewardFn) -> bool:
    """A function (a partial's, a callable object's class) defined in posttrain: a built-in."""
    target = getattr(fn, "func", fn)
    module = getattr(target, "__module__", None) or type(target).__module__
    return module == "posttrain" or module.startswith("posttrain.")


def _traceback(error: BaseException | None) -> str:
    if error is None:
        return ""
    return "\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _to_float(value: Any) -> tuple[float | None, BaseException | None]:
    """(reward, None) for a usable value (None gives None, NaN stays NaN), else (None, the
    problem)."""
    if value is None:
        return None, None
    if isinstance(value, BaseException):
        return None, value
    if isinstance(value, (torch.Tensor,)) and value.numel() == 1:
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy scalar / 0-d array
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None, TypeError(f"returned {_show(value)} ({type(value).__name__}), not a number")
    value = float(value)
    if math.isinf(value):
        return None, ValueError(f"returned {value}, not a finite number")
    return value, None


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _show(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
