"""Ray's processes as a test sees them: the raylets alive, and waiting for pids to be gone."""

import time
from pathlib import Path


def raylets(marker: str = "") -> set[int]:
    """Pids of live raylet processes (whose command line holds `marker`)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "raylet" in cmd and marker in cmd and "/raylet" in cmd.split(" ")[0]:
                found.add(int(proc.name))
    return found


def wait_gone(pids: set[int], seconds: float = 15.0) -> set[int]:
    deadline = time.time() + seconds
    while time.time() < deadline:
        pids = {p for p in pids if Path(f"/proc/{p}").exists()}
        if not pids:
            break
        time.sleep(0.2)
    return pids
