"""One run at a time in a run directory: an exclusive `flock` on `RUN_DIR/.lock`.

A run holds the lock from its start (before it reads or writes anything in the folder) to the
end of `final/`; a second run in the same folder, whatever its `trainer.resume` and
`trainer.overwrite`, is refused at once with the folder and the holder's pid. The kernel drops
an flock when its holder dies, SIGKILL included, so a dead run never leaves a stale lock: the
file stays, the lock does not. Under torchrun only rank 0 holds it, under Ray only the driver
(`trainers/loop.run`). On a network filesystem the lock is as good as its flock (Linux NFSv4
maps it to a lock on the server).

No torch import here: a test holds the lock from a bare subprocess with this same function.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirBusy(ValueError):
    """Another live process holds the run directory's lock."""


def acquire(run_dir: str | Path) -> int:
    """Take `run_dir`'s lock (making the folder) and write this pid into it; returns the file
    descriptor that holds it (`os.close` releases it). Raises RunDirBusy, naming the holder."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():  # mkdir would say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, "is a file, not a folder: name a folder in trainer.output_dir",
                                 str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(
            f"trainer.output_dir={run_dir} is in use by another run (pid {holder}, still running): two runs "
            f"in one folder would overwrite each other's checkpoints, metrics and model. Wait for it to end "
            f"(or stop it), or write this run to another trainer.output_dir.") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def hold(run_dir: str | Path) -> Iterator[None]:
    """Hold `run_dir`'s lock for the `with` block (see `acquire`)."""
    fd = acquire(run_dir)
    try:
        yield
    finally:
        os.close(fd)


def check_free(run_dir: str | Path) -> None:
    """Refuse now, before a model loads, when another run holds `run_dir` (see `acquire`); the
    lock itself is taken when the run starts. A folder that does not exist yet is free."""
    if (Path(run_dir) / LOCK_FILE).exists():
        os.close(acquire(run_dir))
