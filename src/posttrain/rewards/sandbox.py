"""Run untrusted Python (model-generated code) in a sandbox, for rewards such as `code_tests`.

`run_python(code, stdin)` runs `code` as `main.py` in a separate interpreter
(`python -I -S`: isolated mode, no site-packages) and returns a `SandboxResult`.
`run_python_tests(code, tests)` runs `code`, then assert-style tests, in one sandboxed
process and returns the fraction that passed. What confines the code, strongest first:

- Namespaces (where the kernel allows them): a new network namespace (no interface up, so
  no network, not even 127.0.0.1), a pid namespace (when its init exits the kernel kills
  everything left, including processes that escaped with setsid), a mount namespace with a
  new root that holds only /usr, /bin, /lib*, /etc and the interpreter (read-only, nosuid),
  five devices, a fresh /proc, and /tmp: the working directory, a tmpfs of `max_file_mb`
  and the only writable place; fresh ipc and uts namespaces. As root this needs nothing
  else; as another user it needs unprivileged user namespaces.
- Root only: the code runs as a fresh uid drawn per run (2**30 and up), so RLIMIT_NPROC is
  enforced (it never is for uid 0), root-only files are unreadable, and concurrent runs
  cannot signal or trace each other.
- rlimits: CPU seconds, address space (`memory_mb`), file size, processes, open files, no
  core dumps; no_new_privs (setuid binaries give no privileges).
- Fallback without namespaces: a seccomp filter that refuses socket() for any family but
  AF_UNIX and any new namespace (unshare, clone with CLONE_NEWUSER) (or, where seccomp is
  missing, a Python-level patch of `socket`, which is weaker);
  the init, a child subreaper, kills every descendant of the program when it ends; as root,
  a sweep then kills any process of the run's uid and removes its files from /tmp,
  /var/tmp and /dev/shm.
- The parent keeps the wall-clock timeout and reads at most `max_output_bytes` per stream;
  on either it SIGKILLs the whole process group (and so the pid namespace).

`isolation()` says which of these are in effect here; docs/sandbox.md has the threat model.
"""

from __future__ import annotations

import ast
import marshal
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from posttrain.rewards._sandbox_process import (
    Limits,
    Plan,
    Run,
    collect,
    remove_tree,
    stop,
    sweep_uid,
)

__all__ = [
    "CaseOutcome",
    "CodeTestsResult",
    "Isolation",
    "SandboxError",
    "SandboxResult",
    "isolation",
    "network_isolation",
    "run_python",
    "run_python_tests",
]

# The wrapper imports the child module (rather than running it as a script) so that its
# bytecode is cached, and takes its directory off sys.path again at once. The child imports
# `_sandbox_program` from that directory at its top, before any setup.
_BOOT = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    "import _sandbox_child; del sys.path[0]; _sandbox_child.main(sys.argv)"
)
_UID_BASE, _UID_SPAN = 1 << 30, 1 << 28  # per-run uids, far from any real account
_NOFILE = 64
_RECORD_BYTES = 512  # room per test record on the result pipe


class SandboxError(RuntimeError):
    """The sandbox could not be set up on this host. Never raised for anything the code does."""


@dataclass
class SandboxResult:
    """What one sandboxed run did."""

    returncode: int | None
    """Exit status of the program; -N if signal N ended it; None if the sandbox stopped it."""
    stdout: str
    stderr: str
    timed_out: bool
    error: str | None
    """Why the sandbox stopped or limited the program, if it did: "timeout", "output limit",
    "memory limit", "cpu limit", "file size limit", "killed by signal N" or "sandbox process
    died". None for a program that ended by itself (whatever its exit status)."""
    duration_s: float
    """Wall-clock seconds from spawn to exit, setup included."""
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exited with status 0 and was not stopped."""
        return self.returncode == 0 and self.error is None


@dataclass
class CaseOutcome:
    """One test of `run_python_tests`."""

    source: str
    passed: bool
    error: str | None
    """`Type: message` of the failure, or why the test did not run; None if it passed."""


@dataclass
class CodeTestsResult:
    """Outcome of `run_python_tests`."""

    passed: int
    total: int
    cases: list[CaseOutcome]
    code_error: str | None
    """What the code itself raised before the tests ran (the tests still run)."""
    run: SandboxResult
    """The sandboxed process: stdout, stderr, timeout, limits hit."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total


@dataclass(frozen=True)
class Isolation:
    """Which confinement is in effect on this host (see the module docstring)."""

    network: str
    """Either "netns" (a network namespace) or "socket-block" (sockets refused)."""
    socket_block: str | None
    """How sockets are refused with "socket-block": "seccomp" (a kernel filter, inherited by
    subprocesses) or "python" (a patch of the `socket` module, which code can get around).
    None with "netns"."""
    namespaces: bool
    """pid, mount, ipc and uts namespaces: read-only filesystem, nothing outlives a run."""
    per_run_uid: bool
    """The code runs as a fresh unprivileged uid (the caller is root)."""


def run_python(
    code: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    *,
    max_output_bytes: int = 1 << 20,
    max_processes: int = 16,
    max_file_mb: int = 16,
    cpu_s: int | None = None,
    env: dict[str, str] | None = None,
) -> SandboxResult:
    """Run `code` as `main.py` in the sandbox, feeding it `stdin`.

    Args:
        code: Python source, run as `__main__` by the interpreter running this library
            (`-I -S`: no site-packages, so the standard library only).
        stdin: text given on standard input.
        timeout_s: wall-clock limit, setup included (~30 ms); then the run is killed.
        memory_mb: address-space limit (RLIMIT_AS) of each process, in MiB.
        max_output_bytes: cap on each of stdout and stderr; the run is killed past it.
        max_processes: processes and threads the code may have at once, itself included
            (RLIMIT_NPROC; enforced only with a per-run uid or a user namespace).
        max_file_mb: largest file the code may write (RLIMIT_FSIZE) and, with namespaces,
            the size of its whole working directory.
        cpu_s: CPU seconds per process (RLIMIT_CPU); default `ceil(timeout_s) + 1`.
        env: extra environment variables; the rest is PATH, HOME, TMPDIR and LANG only.

    Returns:
        A `SandboxResult`. Anything the code does (crash, hang, fork bomb, huge output)
        ends up in it; `SandboxError` is raised only if the sandbox cannot be set up.
    """
    limits = _limits(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, cpu_s)
    run = _execute(
        _host_plan(), "script", code, stdin.encode("utf-8", "surrogatepass"), limits, env
    )
    return _interpret(run)


def run_python_tests(
    code: str,
    tests: list[str] | str,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    *,
    max_output_bytes: int = 1 << 20,
    max_processes: int = 16,
    max_file_mb: int = 16,
    cpu_s: int | None = None,
) -> CodeTestsResult:
    """Run `code`, then `tests`, in one sandboxed process, and count the tests that pass.

    Args:
        code: the solution; run first, as module `solution` (so an
            `if __name__ == "__main__":` block does not run, and tests may
            `from solution import f`).
        tests: a list, one test per item (each may span several lines), or one string, in
            which every top-level `assert` and bare expression (such as `check(f)`) is a
            test and every other statement (imports, defs, assignments) is setup that
            runs in order but is not counted.
        timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, cpu_s: as in
            `run_python`, for the whole process (the code and every test).

    A test passes if it runs without raising. The tests see the solution's names but the
    original builtins, even if the solution rebinds them. Results come back over a pipe,
    tagged with a per-run nonce that the code cannot print or write in advance; a test
    whose result never arrives (crash, timeout, `os._exit`) fails. See docs/sandbox.md for
    what this does not stop.

    Raises:
        ValueError: if there is no test, or a test is not valid Python (a dataset error).
    """
    sources, counted = _split_tests(tests)
    limits = _limits(timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, cpu_s)
    run = _execute(
        _host_plan(),
        "tests",
        code,
        marshal.dumps(sources),
        limits,
        None,
        result_cap=max_output_bytes + _RECORD_BYTES * len(sources),
    )
    result = _interpret(run)
    outcomes, code_error = _parse_records(run.results, len(sources))
    not_run = f"not run ({result.error})" if result.error else "not run"
    cases = [
        CaseOutcome(src, *outcomes.get(i, (False, not_run)))
        for i, src in enumerate(sources)
        if counted[i]
    ]
    passed = sum(case.passed for case in cases)
    return CodeTestsResult(passed, len(cases), cases, code_error, result)


def isolation() -> Isolation:
    """The confinement in effect on this host (probed once, on first use)."""
    plan = _host_plan()
    return Isolation(
        network="netns" if plan.namespaces else "socket-block",
        socket_block=plan.socket_block,
        namespaces=plan.namespaces,
        per_run_uid=os.geteuid() == 0,
    )


def network_isolation() -> str:
    """How the sandbox keeps code off the network on this host: "netns" or "socket-block"."""
    return isolation().network


# --- choosing what this host supports --------------------------------------------------

_PLANS = (Plan(True, None), Plan(False, "seccomp"), Plan(False, "python"))
_PROBE_LIMITS = Limits(10.0, 256, 10, 1 << 16, 8, 1)
_plan: Plan | None = None
_plan_failure: str | None = None
_plan_lock = threading.Lock()


def _host_plan() -> Plan:
    """The strongest plan that runs `pass` here; probed once per process."""
    global _plan, _plan_failure
    with _plan_lock:
        if _plan is None and _plan_failure is None:
            failures = []
            for plan in _PLANS:
                try:
                    result = _interpret(_execute(plan, "script", "pass", b"", _PROBE_LIMITS, None))
                except SandboxError as exc:
                    failures.append(f"{plan}: {exc}")
                    continue
                if result.ok:
                    _plan = plan
                    break
                failures.append(f"{plan}: exit {result.returncode}: {result.stderr[-500:]}")
            else:
                _plan_failure = "no sandbox works on this host:\n" + "\n".join(failures)
        if _plan is None:
            raise SandboxError(_plan_failure)
        return _plan


def _limits(
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
    max_processes: int,
    max_file_mb: int,
    cpu_s: int | None,
) -> Limits:
    checks = {
        "timeout_s": timeout_s > 0,
        "memory_mb": memory_mb >= 32,
        "max_output_bytes": max_output_bytes >= 1,
        "max_processes": max_processes >= 1,
        "max_file_mb": max_file_mb >= 1,
        "cpu_s": cpu_s is None or cpu_s >= 1,
    }
    for name, fine in checks.items():
        if not fine:
            raise ValueError(f"{name} is out of range: {locals()[name]!r}")
    cpu = math.ceil(timeout_s) + 1 if cpu_s is None else int(cpu_s)
    return Limits(timeout_s, memory_mb, cpu, max_output_bytes, max_processes, max_file_mb)


# --- one run ---------------------------------------------------------------------------


def _execute(
    plan: Plan,
    mode: str,
    code: str,
    stdin: bytes,
    limits: Limits,
    env: dict[str, str] | None,
    result_cap: int = 0,
) -> Run:
    """Spawn the sandbox for one run and collect what it did; leave nothing behind."""
    root = os.geteuid() == 0
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if root else -1
    python = os.path.realpath(sys.executable)
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    filename = "solution.py" if mode == "tests" else "main.py"
    Path(workdir, filename).write_bytes(code.encode("utf-8", "surrogatepass"))
    if root:
        os.chown(workdir, uid, uid)
    ctl_r, ctl_w = os.pipe()
    res_r, res_w = os.pipe() if mode == "tests" else (-1, -1)
    nproc = limits.max_processes + (2 if plan.namespaces and not root else 0)  # + wrapper, init
    settings = {
        "mode": mode,
        "workdir": workdir,
        "python": python,
        "parent": os.getpid(),
        "ctl": ctl_w,
        "res": res_w,
        "uid": uid,
        "namespaces": int(plan.namespaces),
        "userns": int(plan.namespaces and not root),
        "seccomp": int(plan.socket_block == "seccomp"),
        "block_sockets": int(plan.socket_block == "python"),
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_mb << 20,
        "file_bytes": limits.max_file_mb << 20,
        "nproc": nproc if root or plan.namespaces else 0,
        "nofile": _NOFILE,
    }
    args = [f"{k}={v}" for k, v in settings.items()]
    args += [
        f"interpreter={p}" for p in (os.path.realpath(sys.base_prefix), os.path.dirname(python))
    ]
    proc = run = None
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [python, "-I", "-S", "-X", "utf8", "-c", _BOOT, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=_environment("/tmp" if plan.namespaces else workdir, env),
            start_new_session=True,
            pass_fds=[fd for fd in (ctl_w, res_w) if fd >= 0],
        )
        for fd in (ctl_w, res_w):
            if fd >= 0:
                os.close(fd)
        ctl_w = res_w = -1
        run = collect(proc, stdin, ctl_r, res_r, limits, result_cap, start)
        return run
    finally:
        if proc is not None:
            stop(proc, plan, run.control if run is not None else [])
        if root and not plan.namespaces:
            sweep_uid(uid)
        for fd in (ctl_r, ctl_w, res_r, res_w):
            if fd >= 0:
                os.close(fd)
        remove_tree(workdir)


def _environment(workdir: str, extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
    }
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"env must map str to str, got {key!r}: {value!r}")
        env[key] = value
    return env


# --- interpreting a run -----------------------------------------------------------------


def _interpret(run: Run) -> SandboxResult:
    status = None
    started = False
    for line in run.control:
        kind, _, rest = line.partition(" ")
        if kind == "setup-error":
            raise SandboxError(f"{rest}\n{run.stderr.decode(errors='replace')[-2000:]}")
        started = started or kind == "started"
        if kind == "status":
            status = int(rest)
    stderr = run.stderr.decode("utf-8", "replace")
    # A status arrives only if the program ended by itself (it may still have overflowed).
    returncode = None if status is None else os.waitstatus_to_exitcode(status)
    error = run.stopped
    if error is None:
        if returncode is not None:
            error = _classify(returncode, stderr)
        elif started:
            error = "sandbox process died"
        else:
            raise SandboxError(f"the sandbox exited during setup:\n{stderr[-2000:]}")
    return SandboxResult(
        returncode=returncode,
        stdout=run.stdout.decode("utf-8", "replace"),
        stderr=stderr,
        timed_out=run.stopped == "timeout",
        error=error,
        duration_s=run.duration_s,
        stdout_truncated=run.stdout_truncated,
        stderr_truncated=run.stderr_truncated,
    )


def _classify(returncode: int, stderr: str) -> str | None:
    """Name the limit that ended a run, from its exit status and last stderr line."""
    if returncode < 0:
        return "cpu limit" if -returncode == signal.SIGXCPU else f"killed by signal {-returncode}"
    if returncode != 0:
        last = stderr.rstrip().rpartition("\n")[2]
        if last.startswith("MemoryError"):
            return "memory limit"
        if "[Errno 27] File too large" in last or "[Errno 28] No space left" in last:
            return "file size limit"
    return None


def _split_tests(tests: list[str] | str) -> tuple[list[str], list[bool]]:
    """Test sources, and whether each counts (setup statements of a test string do not)."""
    if isinstance(tests, str):
        try:
            tree = ast.parse(tests)
        except SyntaxError as exc:
            raise ValueError(f"tests are not valid Python: {exc}") from exc
        sources = [ast.unparse(node) for node in tree.body]
        counted = [
            isinstance(node, ast.Assert)
            or (isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant))
            for node in tree.body
        ]
    else:
        sources = list(tests)
        counted = [True] * len(sources)
        for i, src in enumerate(sources):
            try:
                compile(src, f"<test {i}>", "exec")
            except (SyntaxError, ValueError) as exc:
                raise ValueError(f"test {i} is not valid Python: {exc}") from exc
    if not any(counted):
        raise ValueError("no tests to run")
    return sources, counted


_START = re.compile(r"([0-9a-f]{32}) start")


def _parse_records(results: bytes, n: int) -> tuple[dict[int, tuple[bool, str | None]], str | None]:
    """Per-test (passed, error) and the code's own error, from the harness's records.

    The first line announces the nonce (it is written before any untrusted code runs);
    later lines without it are ignored, and only the first record of each test counts.
    """
    lines = results.decode("utf-8", "replace").splitlines()
    start = _START.fullmatch(lines[0]) if lines else None
    if start is None:
        return {}, None
    nonce = start.group(1)
    outcomes: dict[int, tuple[bool, str | None]] = {}
    code_error = None
    for line in lines[1:]:
        tag, _, rest = line.partition(" ")
        if tag != nonce:
            continue
        kind, _, detail = rest.partition(" ")
        if kind == "done":
            break
        if kind == "code":
            code_error = code_error or detail
        elif kind.isdigit() and int(kind) < n and int(kind) not in outcomes:
            verdict, _, message = detail.partition(" ")
            outcomes[int(kind)] = (True, None) if verdict == "pass" else (False, message or None)
    return outcomes, code_error
