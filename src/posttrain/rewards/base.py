"""What every reward module shares, below them all: TRL's run keyword arguments, the text of a
completion, and a map over daemon threads with a deadline (the runner, the judge, the code
tests and the environments' tools use it)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RUN_KWARGS = ("trainer_state", "log_metric")
"""TRL's keyword arguments of the run, not of the data: given to a function that names them or
takes **kwargs (a function that builds per-row dicts from **kwargs must leave them out)."""


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, a message dict, or a list of messages (the last one)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence) and completion:
        return completion_text(completion[-1])
    return ""


def map_in_daemon_threads(
    fn: Callable[[Any], Any], items: Sequence[Any], workers: int, timeout_s: float | None = None
) -> tuple[list[Any], list[BaseException | None], list[threading.Thread]]:
    """`[fn(x) for x in items]` on up to `workers` daemon threads, waiting at most `timeout_s`.

    Returns (results, errors, stragglers): results[i] is fn(items[i]) (None if it raised or did
    not finish), errors[i] the exception it raised, a `TimeoutError` if it did not finish in
    time, or None; stragglers are the threads still running at the deadline (abandoned: what
    they finish later is thrown away).
    """
    n = len(items)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [TimeoutError(f"not finished within {timeout_s} s")] * n
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    lock, closed = threading.Lock(), [False]

    def work() -> None:
        while not closed[0]:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                value, error = fn(items[i]), None
            except BaseException as e:  # noqa: BLE001 - reported through `errors`
                value, error = None, e
            with lock:
                if not closed[0]:
                    results[i], errors[i] = value, error

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(workers, n))]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with lock:
        closed[0] = True
        return list(results), list(errors), [t for t in threads if t.is_alive()]
