"""The loop of one reward worker process (`posttrain.rewards.isolation`), run as a script.

It imports only the standard library and cloudpickle, so it starts in a few tens of
milliseconds: a function pickled by value (a `file.py:name` reward) needs nothing else, one
pickled by reference (a built-in) imports its module on its first call. Messages are pickles
over stdin (calls in) and the original stdout (answers out); the user's prints go to stderr.
SIGINT is ignored: Ctrl-C is the trainer's to handle, and the worker ends when the trainer
closes its pipe (or dies).

    parent -> worker: sys.path (once), then (function pickle, kwargs, wants log_metric) per call
                      (kwargs None: only load the function, as a fresh worker warms up)
    worker -> parent: ("ok", value, logged) | ("error", exception pickle or None, "Class: message",
                      [(file, line, function), ...], traceback text, logged)
"""

import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    calls = Connection(os.dup(0), writable=False)
    answers = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # the protocol owns the old stdout; prints go to stderr
    sys.path[:] = pickle.loads(calls.recv_bytes())
    import cloudpickle  # noqa: F401 - unpickles what the trainer pickled by value

    functions: dict[bytes, object] = {}  # a function keeps its state across calls in this worker
    while True:
        try:
            message = calls.recv_bytes()
        except EOFError:
            return
        answers.send_bytes(answer(message, functions))


def answer(message: bytes, functions: dict) -> bytes:
    """The pickled answer to one pickled call (module docstring)."""
    logged: list = []
    try:
        payload, kwargs, wants_log = pickle.loads(message)
        if payload not in functions:
            functions[payload] = pickle.loads(payload)
        if kwargs is None:  # warming up: the function is loaded, its modules imported
            return pickle.dumps(("ok", None, logged))
        if wants_log:
            kwargs["log_metric"] = lambda name, value: logged.append((str(name), float(value)))
        return pickle.dumps(("ok", functions[payload](**kwargs), logged))
    except BaseException as error:  # noqa: BLE001 - SystemExit too: counted, the worker lives on
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(error.__traceback__)]
        trace = "".join(traceback.format_exception(error))
        return pickle.dumps(("error", _portable(error), f"{type(error).__name__}: {error}", frames, trace, logged))


def _portable(error: BaseException) -> bytes | None:
    """The exception pickled, or None when it does not pickle (the parent rebuilds it from text)."""
    try:
        return pickle.dumps(error.with_traceback(None))
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
