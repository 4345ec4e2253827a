"""The sandbox's process plumbing (see `posttrain.rewards.sandbox`): reading the sandbox's
pipes under output caps and a wall-clock deadline (`collect`), and making sure nothing it
started outlives the run (`stop`, `sweep_uid`, `remove_tree`)."""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
"""Where a run without a mount namespace can leave files behind."""


@dataclass(frozen=True)
class Plan:
    namespaces: bool
    socket_block: str | None


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_mb: int
    cpu_s: int
    max_output_bytes: int
    max_processes: int
    max_file_mb: int


@dataclass
class Run:
    """Raw outcome of one sandbox process, before interpretation."""

    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    results: bytes
    control: list[str]
    stopped: str | None  # "timeout" or "output limit": the parent killed it
    duration_s: float


class _Sink:
    """Bytes read from one pipe, up to a cap."""

    def __init__(self, cap: int) -> None:
        self.data = bytearray()
        self.cap = cap
        self.truncated = False
        self.open = True

    def add(self, chunk: bytes) -> bool:
        """Keep what fits; False once the cap is exceeded."""
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.data += chunk[: max(room, 0)]
            self.truncated = True
            return False
        self.data += chunk
        return True


def collect(
    proc: subprocess.Popen,
    stdin: bytes,
    ctl_r: int,
    res_r: int,
    limits: Limits,
    result_cap: int,
    start: float,
) -> Run:
    """Feed stdin and read every pipe until the sandbox exits, times out or overflows."""
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    sinks = {
        out: _Sink(limits.max_output_bytes),
        err: _Sink(limits.max_output_bytes),
        ctl_r: _Sink(1 << 16),
    }
    if res_r >= 0:
        sinks[res_r] = _Sink(result_cap)
    selector = selectors.DefaultSelector()
    for fd in sinks:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    stdin_fd = proc.stdin.fileno()
    if pending:
        os.set_blocking(stdin_fd, False)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    exit_fd = _pidfd(proc.pid)
    if exit_fd >= 0:
        selector.register(exit_fd, selectors.EVENT_READ)
    deadline = start + limits.timeout_s
    stopped = None
    exited = False
    try:
        while not exited and stopped is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = "timeout"
                break
            for key, _ in selector.select(remaining if exit_fd >= 0 else min(remaining, 0.01)):
                if key.fd == exit_fd:
                    exited = True
                elif key.fd == stdin_fd:
                    pending = _feed(stdin_fd, pending)
                    if not pending:
                        selector.unregister(stdin_fd)
                        proc.stdin.close()
                elif not _read(key.fd, sinks[key.fd], selector, once=True) and key.fd != ctl_r:
                    stopped = "output limit"
            if exit_fd < 0 and not exited:
                exited = _exited(proc.pid)
        if exited:  # what the program wrote before it exited is in the pipes already
            for fd, sink in sinks.items():
                if sink.open and not _read(fd, sink, selector, once=False) and fd != ctl_r:
                    stopped = stopped or "output limit"
        elif sinks[ctl_r].open:  # stopped early: still learn the pids the kill needs
            _read(ctl_r, sinks[ctl_r], selector, once=False)
    finally:
        selector.close()
        if exit_fd >= 0:
            os.close(exit_fd)
    return Run(
        stdout=bytes(sinks[out].data),
        stderr=bytes(sinks[err].data),
        stdout_truncated=sinks[out].truncated,
        stderr_truncated=sinks[err].truncated,
        results=bytes(sinks[res_r].data) if res_r >= 0 else b"",
        control=bytes(sinks[ctl_r].data).decode(errors="replace").splitlines(),
        stopped=stopped,
        duration_s=time.monotonic() - start,
    )


def _feed(fd: int, pending: memoryview) -> memoryview:
    try:
        return pending[os.write(fd, pending[: 1 << 16]) :]
    except BlockingIOError:
        return pending
    except OSError:  # the program closed stdin or exited: the rest is not wanted
        return pending[:0]


def _read(fd: int, sink: _Sink, selector: selectors.BaseSelector, once: bool) -> bool:
    """Read what is available (one chunk if `once`); False if the sink overflowed."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            sink.open = False
            selector.unregister(fd)
            return True
        if not sink.add(chunk):
            return False
        if once:
            return True


def _pidfd(pid: int) -> int:
    """A descriptor that turns readable when `pid` exits, or -1 (old kernel or Python)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def stop(proc: subprocess.Popen, plan: Plan, control: list[str]) -> None:
    """Kill whatever is left of the sandbox, and return once all of it is gone.

    With namespaces, SIGKILL to the wrapper's group takes the init with it, and the kernel
    kills the rest of the pid namespace before the init finishes exiting. Without, the
    program has its own group: killing that leaves the init (a subreaper) alive to kill
    the program's descendants (setsid or not) and exit; the wrapper follows.
    """
    started = _pid_after(control, "started")
    if not plan.namespaces and started is not None and not _exited(proc.pid):
        _signal_group(started)
        deadline = time.monotonic() + 2.0
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    _signal_group(proc.pid)  # not reaped yet, so its group id cannot have been reused
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()
    init = _pid_after(control, "init")
    if plan.namespaces and init is not None:
        _wait_until_gone(init)


def _exited(pid: int) -> bool:
    """Whether our child `pid` has exited, without reaping it."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _pid_after(control: list[str], kind: str) -> int | None:
    pids = [int(line.split()[1]) for line in control if line.startswith(kind + " ")]
    return pids[0] if pids else None


def _signal_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_until_gone(pid: int, timeout_s: float = 2.0) -> None:
    """Wait until `pid` (not our child) has exited: it is a zombie or gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            return
        if state in "ZX":
            return
        time.sleep(0.002)


def sweep_uid(uid: int) -> None:
    """Without a pid namespace: kill every process of the run's uid and remove its files."""
    for _ in range(100):
        alive = _pids_of(uid)
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)
    for top in WORLD_WRITABLE:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    remove_tree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue
        state = re.search(r"^State:\s+(\S)", status, re.M)
        real = re.search(r"^Uid:\s+(\d+)", status, re.M)
        if real and int(real.group(1)) == uid and not (state and state.group(1) in "ZX"):
            pids.append(int(name))
    return pids


def remove_tree(path: str) -> None:
    """Remove a directory the code may have left unreadable (chmod 000) behind."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError:
        for parent, dirs, _ in os.walk(path):
            for d in dirs:
                try:
                    os.chmod(os.path.join(parent, d), 0o700, follow_symlinks=False)
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)
