"""Cleaning up after a local Ray whose driver died without `RaySession.close` (SIGKILL, the OOM
killer): its `/tmp/ptray-<pid>-*` folder and the Ray processes still serving it (the GCS and the
raylet exit with the driver, Ray's agents and workers outlive it by a minute or more).

Two ways, one `reap`:
- `clean_stale`, when a RaySession starts a local Ray: the folders of dead runs, left by earlier
  runs (and by runs whose watchdog was killed with them).
- the watchdog (`start_watchdog`): this file run as a script, stdlib only, in a session of its own
  (a signal to the driver's process group does not reach it), binding nothing. It polls the
  driver every `POLL_S` and, when it is gone, reaps the driver's folder and exits. `RaySession.close`
  ends it.

A folder's run is dead when its <pid> is not a live process, or is a process started after the
folder was last modified (that pid was reused by a later process: the driver made the folder, so it
started before). A process serves a folder when its command line names the folder (GCS, raylet,
monitors, the watchdog) or when it is one of Ray's (titled `ray::`: agents, workers) with a file
open in it. Only folders of this user; a Ray started with `ray start` (/tmp/ray) is never touched.
Process lookups read /proc (Linux); elsewhere only the folders of dead pids are removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

PREFIX = "ptray-"
POLL_S = 0.5
GRACE_S = 1.0
"""Seconds between SIGTERM and SIGKILL (Ray's agents ignore a SIGTERM once their driver is dead)."""
CLOCK_SLACK_S = 2.0
"""Start times from /proc are in clock ticks after a boot time in whole seconds."""
OWNER = re.compile(rf"{PREFIX}(\d+)-")


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of `pid` from /proc, None when it is
    gone (or there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[19])


def start_ticks(pid: int) -> int:
    """`pid`'s start time in clock ticks after boot (0: unknown, no /proc)."""
    stat = proc_stat(pid)
    return stat[1] if stat else 0


def alive(pid: int, ticks: int = 0) -> bool:
    """`pid` is a live process (not a zombie), and the one started at `ticks` when given."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = proc_stat(pid)
    if stat is None:
        return not Path("/proc/self").exists()  # no /proc: os.kill is all there is
    return stat[0] not in "ZX" and (not ticks or stat[1] == ticks)


def started_at(pid: int) -> float | None:
    """When `pid` started, in seconds since the epoch (None: unknown)."""
    stat = proc_stat(pid)
    if stat is None:
        return None
    btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                 if line.startswith("btime "))
    return btime + stat[1] / os.sysconf("SC_CLK_TCK")


def owner_alive(folder: Path) -> bool:
    """The process that made `folder` (its name's <pid>) still runs: that pid is alive and started
    before the folder was last modified."""
    pid = int(OWNER.match(folder.name).group(1))
    if not alive(pid):
        return False
    start = started_at(pid)
    return start is None or start <= folder.stat().st_mtime + CLOCK_SLACK_S


def stale_folders(root: Path) -> list[Path]:
    """This user's `root/ptray-<pid>-*` folders (not links) whose run is dead."""
    found = []
    for folder in root.glob(f"{PREFIX}*-*"):
        with contextlib.suppress(OSError):  # gone meanwhile (its own run's close, another cleaner)
            if (OWNER.match(folder.name) and folder.is_dir() and not folder.is_symlink()
                    and folder.stat().st_uid == os.getuid() and not owner_alive(folder)):
                found.append(folder)
    return sorted(found)


def names(text: str, folder: Path) -> bool:
    """`text` names `folder` or a path inside it (not a longer name that starts alike)."""
    return re.search(re.escape(str(folder)) + r"(?![\w.-])", text) is not None


def open_paths(pid: int) -> list[str]:
    """The paths of `pid`'s open files (those still open as they are read)."""
    paths = []
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                paths.append(os.readlink(fd))
    return paths


def serving(folders: Iterable[Path]) -> dict[int, str]:
    """{pid: command} of the live processes (not this one) that serve one of `folders`."""
    folders, found = list(folders), {}
    if not folders or not Path("/proc").is_dir():
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        serves = any(names(cmd, f) for f in folders) or (cmd.startswith("ray::") and any(
            names(path, f) for path in open_paths(pid) for f in folders))
        if serves and alive(pid):
            found[pid] = cmd
    return found


def stop(pids: Iterable[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to `pids`, SIGKILL to those still alive after `grace_s`; returns when all are gone
    (or after another `grace_s`)."""
    pids = set(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while (pids := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pids:
            return


def reap(folders: list[Path], grace_s: float = GRACE_S) -> dict[int, str]:
    """Stop the processes serving `folders`, then remove the folders; the {pid: command} stopped."""
    procs = serving(folders)
    stop(procs, grace_s)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return procs


def program(cmd: str) -> str:
    """A process's short name: its Ray title (`ray::IDLE`), else its program's file name."""
    head = cmd.split(" ")[0]
    return head if head.startswith("ray::") else os.path.basename(head)


def clean_stale(root: Path = Path("/tmp"), grace_s: float = GRACE_S) -> str | None:
    """Reap the folders of dead runs under `root`: one line saying what was cleaned, None when
    nothing was."""
    folders = stale_folders(root)
    if not folders:
        return None
    procs = reap(folders, grace_s)
    what = ", ".join(sorted(f"{program(cmd)} (pid {pid})" for pid, cmd in procs.items()))
    return (f"removed {len(folders)} Ray temp folder(s) of dead runs ({', '.join(map(str, folders))})"
            + (f" and stopped {len(procs)} Ray process(es) still serving them: {what}" if procs else ""))


def watch(pid: int, ticks: int, folder: Path, poll_s: float = POLL_S) -> None:
    """Wait for the driver `pid` (started at `ticks`) to be gone, then reap its `folder`."""
    while alive(pid, ticks):
        time.sleep(poll_s)
    reap([folder])


def start_watchdog(folder: Path) -> subprocess.Popen:
    """This file as a script watching this process and `folder`: in a session of its own, no
    stdin/stdout/stderr (a caller reading this process's output is not kept waiting for it), and
    isolated from PYTHON* settings (it needs only the standard library)."""
    return subprocess.Popen(
        [sys.executable, "-I", "-S", __file__, str(os.getpid()), str(start_ticks(os.getpid())), str(folder)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
