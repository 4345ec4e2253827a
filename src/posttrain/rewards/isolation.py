"""reward.isolation=process: the user's reward functions run in a pool of worker processes.

    pool = WorkerPool()
    fn = in_worker(my_reward, pool, timeout_s=10.0)   # called like my_reward, by the runner
    fn(prompts=..., completions=..., completion_ids=...)
    pool.close()

What it protects against, beyond what the thread runner does (`rewards.runner`): a function
that ends its process (`os._exit`, a segfault in a C extension, the OOM killer) or hangs for
good. Such a call raises here (`WorkerDied`, or `TimeoutError` after `timeout_s`, the worker
then killed), so the runner counts it as it counts a raise (`reward.failure_reward`,
`reward/<fn>/errors`); the dead worker is replaced by a fresh one on the next call.

The price: the function and its arguments are pickled (cloudpickle: a `file.py:name` or
working-folder module is pickled by value, `registry.FILE_MODULES`; an installed module's by reference, imported by the worker as it warms up), each worker keeps its own state (a cache, a
counter; `pop_metrics` of the trainer's copy sees none of it, so such figures go through
`log_metric`, which is forwarded; `trainer_state` arrives as a `SimpleNamespace` copy with
the same fields), and a call costs a round trip through a pipe. posttrain's own functions
(the built-ins: the reward model holds a loaded model, `code_tests` runs code in its own
sandbox) stay in the trainer's process: the runner isolates the user's functions only.

Workers are plain `python _worker_main.py` subprocesses, not `multiprocessing` ones, so a
user's script without an `if __name__ == "__main__":` guard is never imported again; each
starts with the trainer's `sys.path`. They end when the pool closes, or when the trainer
dies (their pipe closes).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

WORKER_MAIN = str(Path(__file__).with_name("_worker_main.py"))
DYNAMIC = "<dynamic-code>"  # cloudpickle's file name of code pickled by value


class WorkerDied(Exception):
    """The worker process ended during a call (os._exit, a signal, the OOM killer)."""

    remote_frames: tuple = ()  # `user_code.raised`: no line of the user's code to point at


class WorkerTimedOut(TimeoutError):
    """The call did not finish within `timeout_s`; the worker process was killed. The runner
    counts it as the timeout it is (no per-sample retry), whichever of its own deadline and
    this one fires first."""

    remote_frames: tuple = ()


class _Worker:
    """One worker process and its two pipe ends."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, WORKER_MAIN], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        self.calls = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.answers = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.calls.send_bytes(pickle.dumps(list(sys.path)))

    def call(self, message: bytes, timeout_s: float) -> tuple:
        """The worker's answer to `message` (`_worker_main`); raises WorkerDied or WorkerTimedOut."""
        try:
            self.calls.send_bytes(message)
            ready = self.answers.poll(timeout_s)
            if not ready:
                raise WorkerTimedOut(f"not finished within {timeout_s} s; its worker process was killed")
            return pickle.loads(self.answers.recv_bytes())
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise WorkerDied(f"the reward worker process died ({_ending(self.proc.wait())})") from None

    def close(self) -> None:
        """End the process (killed: it may hang) and reap it."""
        self.calls.close()
        self.answers.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class WorkerPool:
    """Worker processes, each warmed on `payloads` (the pickled functions `in_worker` was
    given: their modules are imported before a call, not during it). `warm(k)` starts k and
    waits for them. A call takes an idle worker (or starts one when all are busy) and gives
    it back, unless it died or timed out: then it is ended and a fresh one is started and
    warmed in the background. `replaced` counts the workers ended that way."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.payloads: list[bytes] = []
        self.replaced = 0
        atexit.register(self.close)

    def warm(self, k: int) -> None:
        """Start k workers at once and wait until they are warm (a worker's start-up is then
        not spent out of a call's timeout)."""
        threads = [threading.Thread(target=self._start, daemon=True) for _ in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def call(self, message: bytes, timeout_s: float) -> tuple:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or _Worker()
        with self._lock:
            self._busy.add(worker)
        try:
            answer = worker.call(message, timeout_s)
        except BaseException:
            with self._lock:
                self._busy.discard(worker)
                self.replaced += 1
            worker.close()
            self._start_in_background()
            raise
        self._give_back(worker)
        return answer

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed:
                self._idle.append(worker)
                return
        worker.close()

    def _start_in_background(self) -> None:
        threading.Thread(target=self._start, daemon=True).start()

    def _start(self) -> None:
        """A fresh worker, warmed on `payloads`, then idle."""
        with self._lock:
            if self._closed:
                return
        worker = _Worker()
        with self._lock:
            self._busy.add(worker)  # so close() ends it while it warms up
        try:
            for payload in list(self.payloads):
                worker.call(pickle.dumps((payload, None, False)), 600.0)
        except BaseException:  # noqa: BLE001 - a worker that cannot start: calls start their own
            with self._lock:
                self._busy.discard(worker)
            worker.close()
            return
        self._give_back(worker)

    def close(self) -> None:
        """End every worker, idle, busy or warming up."""
        with self._lock:
            self._closed = True
            workers, self._idle, self._busy = [*self._idle, *self._busy], [], set()
        for worker in workers:
            worker.close()
        atexit.unregister(self.close)


def in_worker(fn: Callable[..., Any], pool: WorkerPool, timeout_s: float) -> Callable[..., Any]:
    """`fn`, called in one of `pool`'s workers (module docstring), with `fn`'s signature (the
    runner reads which run arguments it takes). Raises ValueError when `fn` does not pickle."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises, the advice is the same
        raise ValueError(
            f"reward function {getattr(fn, '__name__', fn)!r} cannot be sent to a worker process "
            f"(reward.isolation=process): {type(e).__name__}: {e}. Define it at the top level of a "
            "module or file.py, or use reward.isolation=thread"
        ) from None
    pool.payloads.append(payload)
    home = _source_file(fn)

    def call(**kwargs: Any) -> Any:
        log = kwargs.pop("log_metric", None)
        if dataclasses.is_dataclass(kwargs.get("trainer_state")):  # read in the worker without importing posttrain
            kwargs["trainer_state"] = SimpleNamespace(**vars(kwargs["trainer_state"]))
        answer = pool.call(pickle.dumps((payload, kwargs, log is not None)), timeout_s)
        for name, value in answer[-1]:
            log(name, value)
        if answer[0] == "ok":
            return answer[1]
        raise _rebuilt(*answer[1:5], home)

    return functools.wraps(fn)(call)


def _source_file(fn: Callable[..., Any]) -> str:
    """The file of `fn`'s code ("<dynamic-code>" if unknown)."""
    code = getattr(inspect.unwrap(getattr(fn, "func", fn)), "__code__", None)
    return code.co_filename if code is not None else DYNAMIC


def _rebuilt(pickled: bytes | None, text: str, frames: list, trace: str, home: str) -> BaseException:
    """The worker's exception, with its frames for `user_code.raised` and its traceback as a
    note. Code cloudpickle sent by value runs under the file name "<dynamic-code>" there: it
    is `home`, the function's own file, again."""
    frames = [(home if f == DYNAMIC else f, n, name) for f, n, name in frames]
    trace = trace.replace(f'File "{DYNAMIC}"', f'File "{home}"')
    try:
        error = pickle.loads(pickled) if pickled is not None else RuntimeError(text)
    except Exception:  # noqa: BLE001 - a class the trainer cannot import
        error = RuntimeError(text)
    try:
        error.remote_frames = tuple(traceback.FrameSummary(f, n, name) for f, n, name in frames)
    except AttributeError:  # an exception type with __slots__
        pass
    error.add_note(f"in the reward worker process:\n{trace.rstrip()}")
    return error


def _ending(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
