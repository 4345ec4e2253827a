"""Preemption: SIGTERM (and SIGUSR1) stop a run at a sealed checkpoint.

SLURM, Kubernetes and spot instances send SIGTERM, then SIGKILL after a grace period; SLURM
sends SIGUSR1 ahead of its time limit when asked (`#SBATCH --signal=USR1@120`). While the
training loop runs (`trainers/loop.run`), these signals are handled here:

- `trainer.save_on_signal=true` (the default): the handler only notes the signal. The step
  running finishes, the loop saves a checkpoint of that step (sealed as every checkpoint is,
  `checkpoint.save_checkpoint`) and raises `Preempted`, which the CLI prints as one line
  naming the checkpoint and exits 143 (128 + SIGTERM, as a shell reports a SIGTERMed
  process). A signal that arrives during a save lets the save finish, then the run stops at
  the checkpoint it sealed; more signals meanwhile change nothing. A step whose loss was
  NaN/inf is never saved: the line then names the last good checkpoint.
  A signal at the last step, or after it (the final evaluation, `final/`), lets the run
  finish as it would have: it returns, and the CLI exits 0.
- `trainer.save_on_signal=false`: the handler raises `Preempted` at once (like Ctrl-C's
  KeyboardInterrupt), no save; still one line and exit 143.

With data-parallel ranks (torchrun forwards its SIGTERM to every rank) the ranks agree at
each step's end (MAX over ranks of the signal seen) so that all stop, and save, at the same
step. On Ray the driver runs the loop: the handler is installed by the loop, after
`ray.init` (Ray's own SIGTERM handler would otherwise exit the driver with a stack dump), and
the run's `finally` stops the workers and the Ray it started.

Handlers can only be installed in the main thread; a run driven from another thread (the
Python API in a thread) keeps the process's handlers as they are.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 128 + signal.SIGTERM
"""The CLI's exit status after a preemption, 143, whichever of SIGNALS stopped it."""


class Preempted(BaseException):  # noqa: N818 (like KeyboardInterrupt: a stop, not an error)
    """The run stopped on a signal at `step`; `checkpoint` is the sealed checkpoint to resume
    from (None: none yet); `unsaved` says why no checkpoint was written on the signal ("": one
    was, `checkpoint`). A BaseException, as KeyboardInterrupt is, so that code catching
    Exception (a reward function's runner) does not swallow it."""

    def __init__(self, signame: str, step: int, checkpoint: Path | None, unsaved: str = ""):
        super().__init__(signame, step, checkpoint, unsaved)
        self.signame, self.step, self.checkpoint, self.unsaved = signame, step, checkpoint, unsaved

    def __str__(self) -> str:
        if not self.unsaved:
            return (f"{self.signame} at step {self.step}: saved checkpoint {self.checkpoint}; "
                    "resume with trainer.resume=auto")
        last = (f"the last checkpoint is {self.checkpoint} (trainer.resume=auto resumes from it)"
                if self.checkpoint is not None else "no checkpoint yet")
        return f"{self.signame} at step {self.step}, not saved ({self.unsaved}); {last}"


class Preemption:
    """The signals seen during one run. `save`: trainer.save_on_signal; `collective`: the
    data-parallel ranks' (None: one process). The loop keeps `step` and `checkpoint` current,
    for the line of an immediate stop."""

    def __init__(self, save: bool, collective: Any = None):
        self.save, self.collective = save, collective
        self.signum = 0  # the first signal received here (0: none)
        self.step, self.checkpoint = 0, None
        self.agreed = False  # every rank has seen that one of them got a signal

    @contextlib.contextmanager
    def installed(self) -> Iterator[Preemption]:
        """Handle SIGNALS for the `with` block (main thread only), then restore the handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        first, self.signum = not self.signum, self.signum or signum
        if first and not self.save:
            raise Preempted(signal.Signals(signum).name, self.step + 1, self.checkpoint, "trainer.save_on_signal=false")

    def at(self, step: int, checkpoint: Path | None) -> None:
        """The last step done and the last checkpoint (the line of an immediate stop names the
        step after it, the one running)."""
        self.step, self.checkpoint = step, checkpoint

    def requested(self) -> bool:
        """A signal arrived here or, with ranks, on any rank: every rank answers the same (a
        collective, with ranks)."""
        signum = self.signum
        if self.collective is not None:
            signum = int(self.collective.all_max([float(signum)])[0])
        if signum and not self.agreed:
            self.signum, self.agreed = signum, True  # another rank's signal stops this rank too
        return self.agreed

    def stopped(self, step: int, checkpoint: Path | None, unsaved: str = "") -> Preempted:
        """The exception that ends the run at `step` (see `Preempted`)."""
        return Preempted(signal.Signals(self.signum).name, step, checkpoint, unsaved)
