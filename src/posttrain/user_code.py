"""Errors raised by the user's own code, said the same way wherever it ran.

    with user_code("environment 'my_envs:Shop'"):
        env = factory()
    # KeyError('secret') in Shop.reset becomes UserCodeError:
    # environment 'my_envs:Shop' raised KeyError: 'secret' at /work/my_envs.py:12 (in reset)

User code that stops a run when it raises (a `file.py:name` file or a `module:name`
module as it loads, in `rewards.registry`, `sys.exit` included; any user callable a trainer
calls inside `user_code`) stops it with one line
naming the object, the exception's class and message, and the line of the user's code that
raised it (the innermost frame outside posttrain, the standard library and the installed
packages). It reads the same in the CLI and the Python API, and on the local and the Ray
backends: a Ray worker's `UserCodeError` is raised as itself on the driver
(`distributed.groups`), not as Ray's wrapper with the worker's traceback. The original
exception stays chained (`__cause__`) on the backend that raised it. A reward function never
stops a run by raising (its sample gets reward.failure_reward); its first failure, which a
run that fails on every sample stops with, starts with the same words (`raised`). Nor does
an environment (`envs.driver`: its failures are counted in env/errors, said the same way).
"""

from __future__ import annotations

import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from posttrain.config.core import RunStopped

_NOT_USER = tuple(
    str(Path(p).resolve()) for p in {
        str(Path(__file__).resolve().parent),  # posttrain
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    }
)
"""Folders whose frames are not the user's: posttrain's, the standard library's, the packages'."""


class UserCodeError(RunStopped):
    """The user's code raised (module docstring). Built by `UserCodeError.of`; its one
    argument is the message, so it pickles (a Ray worker sends it to the driver)."""

    @classmethod
    def of(cls, what: str, error: BaseException) -> UserCodeError:
        """`what` (e.g. "reward function 'my_reward'") raised `error`."""
        return cls(describe(what, error))


def describe(what: str, error: BaseException) -> str:
    """"{what} raised {Class}: {message} at {file}:{line} (in {function})"."""
    return f"{what} raised {raised(error)}"


def raised(error: BaseException) -> str:
    """"{Class}: {message} at {file}:{line} (in {function})", the place `user_frame`'s (none
    for an exception never raised)."""
    where = user_frame(error)
    at = f" at {where.filename}:{where.lineno} (in {where.name})" if where is not None else ""
    return f"{type(error).__name__}: {error}{at}"


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `error`'s traceback in the user's code (a file outside _NOT_USER;
    a SyntaxError's own file and line), else its innermost frame; None without a traceback.
    An exception sent from a worker process carries its frames as `remote_frames`."""
    if isinstance(error, SyntaxError) and error.filename:
        return traceback.FrameSummary(error.filename, error.lineno or 0, "<module>")
    remote = getattr(error, "remote_frames", None)  # raised in a reward worker process (rewards.isolation)
    frames = list(remote) if remote is not None else traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if not f.filename.startswith("<")  # <frozen importlib._bootstrap>
            and not str(Path(f.filename).resolve()).startswith(_NOT_USER)]
    return (mine or frames or [None])[-1]


@contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the block as a call into `what`: an exception it raises, or a `sys.exit` (which
    would otherwise end the run without a word), becomes a UserCodeError (one raised by user
    code called deeper inside passes as it is)."""
    try:
        yield
    except UserCodeError:
        raise
    except (Exception, SystemExit) as error:
        raise UserCodeError.of(what, error) from error


def name_of(obj: object) -> str:
    """A user object's name for messages: a function's or class's qualified name (through
    functools.partial), else its class's."""
    obj = getattr(obj, "func", obj)  # functools.partial
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__
