"""Tests for `posttrain.rewards.sandbox`: ordinary runs, the tests harness, hostile code.

Hostile snippets run under each isolation tier this host offers, through the `box` fixture:
"namespaces" (the default where the kernel allows them) and "fallback" (no namespaces:
seccomp socket filter, per-run uid, sweeps). The fallback runs in a helper process that
forces that plan; as root it first gives itself a private mount namespace in which the
interpreter is reachable by other uids (here Python lives under /root, mode 0700), as the
fallback requires. Every hostile snippet prints its uid first, so each test can check that
no process of that uid is left.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from posttrain.rewards import sandbox
from posttrain.rewards.sandbox import network_isolation, run_python, run_python_tests

ROOT = os.geteuid() == 0
UNPRIVILEGED_UID = 12345

# Serves sandbox calls (one JSON line each) under a forced plan; see the module docstring.
HELPER = r"""
import dataclasses, json, os, sys
sys.path.insert(0, sys.argv[3])  # the two modules alone: importing posttrain takes seconds
import _sandbox_child as child, sandbox
del sys.path[0]

plan, uid = sys.argv[1], int(sys.argv[2])
if os.geteuid() == 0:
    prefix = os.path.realpath(sys.base_prefix)
    parts = prefix.strip("/").split("/")
    parents = ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
    blocked = next((p for p in parents if not os.stat(p).st_mode & 0o001), None)
    if blocked:
        child._unshare(child.CLONE_NEWNS)
        child._mount(None, "/", None, child.MS_REC | child.MS_PRIVATE)
        source = os.open(prefix, os.O_PATH)
        child._mount("tmpfs", blocked, "tmpfs", 0, "mode=0755")
        os.makedirs(prefix, exist_ok=True)
        child._mount(f"/proc/self/fd/{source}", prefix, None, child.MS_BIND | child.MS_REC)
    if uid:
        import resource
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))  # keeps fork bombs small here
        os.chdir("/")
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
if plan != "auto":
    sandbox._plan = sandbox.Plan(False, plan)
print("ready", flush=True)
for line in sys.stdin:
    name, args, kwargs = json.loads(line)
    try:
        result = getattr(sandbox, name)(*args, **kwargs)
        out = dataclasses.asdict(result)
        out.update({p: getattr(result, p) for p in ("ok", "fraction") if hasattr(result, p)})
    except Exception as exc:
        out = {"exception": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
"""


def _namespace(value):
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_namespace(v) for v in value]
    return value


class Helper:
    """`run_python`, `run_python_tests` and `isolation` in a helper process."""

    def __init__(self, plan: str, uid: int = 0) -> None:
        self.tier = plan
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HELPER, plan, str(uid), str(Path(sandbox.__file__).parent)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def call(self, name: str, *args, **kwargs):
        self.proc.stdin.write(json.dumps([name, args, kwargs]) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        assert "exception" not in out, out
        return _namespace(out)

    def run(self, code: str, **kwargs):
        return self.call("run_python", code, **kwargs)

    def tests(self, code: str, tests, **kwargs):
        return self.call("run_python_tests", code, tests, **kwargs)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


class InProcess:
    tier = "namespaces"

    def run(self, code: str, **kwargs):
        return run_python(code, **kwargs)

    def tests(self, code: str, tests, **kwargs):
        return run_python_tests(code, tests, **kwargs)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module", params=["namespaces", "fallback"])
def box(request):
    if request.param == "namespaces":
        if not sandbox.isolation().namespaces:
            pytest.skip("this host does not allow namespaces")
        box = InProcess()
    else:
        box = Helper("seccomp")
        try:
            box.run("pass")
        except AssertionError as exc:
            box.close()
            pytest.skip(f"the seccomp fallback does not work here: {exc}")
    yield box
    box.close()


def processes_of(uid: int) -> list[str]:
    """Live processes whose real uid is `uid`, as 'pid state name'."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
            found.append(f"{pid} {fields['State'].strip()} {fields['Name'].strip()}")
    return found


def uid_of(result) -> int:
    return int(result.stdout.split("\n", 1)[0])


def skip_if_unconfined(box, what: str) -> None:
    """The fallback run by a non-root caller is the caller: it can fork and write freely."""
    if box.tier == "fallback" and not ROOT:
        pytest.skip(f"not root and no namespaces: nothing limits {what}")


def assert_nothing_left(result) -> None:
    uid = uid_of(result)
    if uid == os.geteuid():
        return  # not root: the code ran as ourselves, so there is no uid to sweep for
    assert processes_of(uid) == []


PRINT_UID = "import os\nprint(os.getuid(), flush=True)\n"


# --- ordinary runs ----------------------------------------------------------------------


def test_stdin_stdout_round_trip():
    result = run_python("import sys\nprint(sys.stdin.read().upper(), end='')", stdin="héllo\n")
    assert result.ok
    assert result.stdout == "HÉLLO\n"
    assert (result.returncode, result.timed_out, result.error) == (0, False, None)


def test_large_stdin_is_fed_while_output_is_read():
    text = "x" * 300_000 + "\n"
    result = run_python("import sys\nsys.stdout.write(sys.stdin.read())", stdin=text)
    assert result.ok
    assert result.stdout == text


def test_nonzero_exit_with_traceback():
    result = run_python("def f():\n    raise ValueError('bad input')\nf()")
    assert result.returncode == 1
    assert result.error is None
    assert result.stderr.startswith('Traceback (most recent call last):\n  File "main.py"')
    assert result.stderr.rstrip().endswith("ValueError: bad input")
    assert "_sandbox_child" not in result.stderr


def test_exit_status_and_builtins_exit():
    assert run_python("import sys\nsys.exit(3)").returncode == 3
    assert run_python("exit(4)").returncode == 4
    result = run_python("print('a'\n")
    assert result.returncode == 1
    assert "SyntaxError" in result.stderr


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    result = run_python("import os, json\nprint(json.dumps(dict(os.environ)))", env={"EXTRA": "1"})
    env = json.loads(result.stdout)
    assert "POSTTRAIN_TEST_SECRET" not in env
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "EXTRA"}


def test_working_directory_is_removed(monkeypatch):
    made = []
    real = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording_mkdtemp)
    assert run_python("open('f.txt', 'w').write('x')").ok
    assert made and not any(os.path.exists(path) for path in made)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=1)
    with pytest.raises(TypeError, match="env"):
        run_python("pass", env={"A": 1})


def test_network_isolation_names_the_mechanism():
    info = sandbox.isolation()
    assert network_isolation() == info.network
    assert info.network in ("netns", "socket-block")
    assert (info.network == "netns") == info.namespaces
    assert info.per_run_uid == ROOT


def test_concurrent_runs_stay_apart():
    from concurrent.futures import ThreadPoolExecutor

    fds_before = len(os.listdir("/proc/self/fd"))
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * 2)"), range(12)))
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(12)]
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no descriptor leaks


def test_per_call_overhead_is_small():
    durations = []
    for _ in range(5):
        start = time.perf_counter()
        assert run_python("pass").ok
        durations.append(time.perf_counter() - start)
    assert statistics.median(durations) < 0.5  # ~30 ms here when idle; generous for CI load


# --- run_python_tests -------------------------------------------------------------------

SOLUTION = "def add(a, b):\n    return a + b\n"


def test_tests_count_passes():
    result = run_python_tests(
        SOLUTION, ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(2, 2) == 5"]
    )
    assert (result.passed, result.total) == (2, 3)
    assert result.fraction == pytest.approx(2 / 3)
    assert [c.passed for c in result.cases] == [True, True, False]
    assert result.cases[2].error == "AssertionError"
    assert result.code_error is None


def test_tests_from_one_string_count_only_asserts_and_calls():
    tests = (
        "import math\n"
        "def check(f):\n    assert f(1, 1) == 2\n"
        "assert add(0, 0) == 0\n"
        "check(add)\n"
        "assert add(1, 1) == 3\n"
    )
    result = run_python_tests(SOLUTION, tests)
    assert (result.passed, result.total) == (2, 3)
    assert [c.source for c in result.cases] == [
        "assert add(0, 0) == 0",
        "check(add)",
        "assert add(1, 1) == 3",
    ]


def test_tests_run_even_if_the_code_fails():
    result = run_python_tests("def f():\n    return 1\nraise SystemExit(0)", ["assert f() == 1"])
    assert result.passed == 1
    assert result.code_error == "SystemExit: 0"


def test_bad_tests_are_a_dataset_error():
    with pytest.raises(ValueError, match="test 1"):
        run_python_tests(SOLUTION, ["assert True", "assert ("])
    with pytest.raises(ValueError, match="no tests"):
        run_python_tests(SOLUTION, "import math")


def test_a_hanging_test_keeps_earlier_results():
    result = run_python_tests(
        "def f(x):\n    while x:\n        pass\n    return 0",
        ["assert f(0) == 0", "assert f(1) == 0", "assert f(0) == 0"],
        timeout_s=1,
    )
    assert [c.passed for c in result.cases] == [True, False, False]
    assert result.run.timed_out
    assert result.cases[1].error == "not run (timeout)"


# Each faker's add is wrong. The builtin-based tests pass on their merits wherever the
# harness gets to run them, so the honest score is 2 of 3, or 0 if the tests never ran.
FAKERS = {
    "prints fake records": (
        "import os, sys\n"
        "print('3/3 tests passed')\n"
        "for i in range(3):\n"
        "    line = f'{\"0\" * 32} {i} pass\\n'\n"
        "    sys.stdout.write(line)\n"
        "    os.write(3, line.encode())\n"
        "def add(a, b):\n    return 0\n",
        2,
    ),
    "fakes the start line": (
        "import os\n"
        "os.write(3, b'%s start\\n' % (b'f' * 32))\n"
        "for i in range(3):\n"
        "    os.write(3, b'%s %d pass\\n' % (b'f' * 32, i))\n"
        "os.write(3, b'%s done\\n' % (b'f' * 32))\n"
        "def add(a, b):\n    return 0\n",
        2,
    ),
    "rebinds builtins": (
        "import builtins\n"
        "builtins.sorted = lambda *a, **k: [1, 2, 3]\n"
        "builtins.len = lambda x: 3\n"
        "builtins.AssertionError = type('Nothing', (Exception,), {})\n"
        "def add(a, b):\n    return 0\n",
        2,
    ),
    "shadows builtins as globals": (
        "def sorted(*a, **k):\n    return [1, 2, 3]\n"
        "def len(x):\n    return 3\n"
        "def add(a, b):\n    return 0\n",
        2,
    ),
    "exits before the tests": ("import os\ndef add(a, b):\n    return 0\nos._exit(0)\n", 0),
    "exits inside a test": ("import os\ndef add(a, b):\n    os._exit(0)\n", 0),
    "closes the result pipe": ("import os\nos.close(3)\ndef add(a, b):\n    return 0\n", 0),
}


@pytest.mark.parametrize("name", sorted(FAKERS))
def test_code_cannot_fake_the_score(name):
    code, honest = FAKERS[name]
    tests = [
        "assert add(1, 2) == 3",
        "assert sorted([3, 1, 2]) == [1, 2, 3]",
        "assert len([1, 2]) == 2",
    ]
    result = run_python_tests(code, tests)
    assert not result.cases[0].passed
    assert result.passed == honest


# --- hostile snippets, under every tier ---------------------------------------------------


def test_infinite_loop_times_out(box):
    start = time.monotonic()
    result = box.run(PRINT_UID + "while True:\n    pass", timeout_s=1)
    assert time.monotonic() - start < 5
    assert result.timed_out
    assert result.error == "timeout"
    assert result.returncode is None
    assert_nothing_left(result)


def test_fork_bomb_is_contained(box):
    skip_if_unconfined(box, "the number of processes")
    bomb = PRINT_UID + (
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"  # try to leave the process group too
        "    except OSError:\n"
        "        pass\n"
    )
    result = box.run(bomb, timeout_s=2, max_processes=16)
    assert result.timed_out
    assert_nothing_left(result)
    assert box.run("print(6 * 7)").stdout == "42\n"  # the host is still fine


def test_background_processes_do_not_outlive_the_run(box):
    code = PRINT_UID + (
        "import time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(60)\n"
        "print('parent exits')\n"
    )
    result = box.run(code, timeout_s=5)
    assert result.ok
    assert result.duration_s < 4  # the run ended with its main process
    assert_nothing_left(result)


def test_huge_allocation_hits_the_memory_limit(box):
    result = box.run(PRINT_UID + "x = bytearray(10 * 1024**3)", memory_mb=256)
    assert result.returncode == 1
    assert result.error == "memory limit"
    assert "MemoryError" in result.stderr


def test_cpu_limit(box):
    result = box.run("while True:\n    pass", timeout_s=10, cpu_s=1)
    assert result.error == "cpu limit"
    assert result.returncode == -24  # SIGXCPU
    assert not result.timed_out


def test_file_size_limit(box):
    result = box.run("open('big', 'wb').write(b'0' * (3 << 20))", max_file_mb=2)
    assert result.error == "file size limit"


def test_writes_outside_the_working_directory_fail(box):
    skip_if_unconfined(box, "writes")
    outside = Path(tempfile.mkdtemp(prefix="posttrain-test-"))  # root-owned, 0755 as root
    outside.chmod(0o755)
    targets = [
        outside / "pwned",
        Path(f"/tmp/posttrain-pwned-{uuid.uuid4().hex}"),
        Path(f"/dev/shm/posttrain-pwned-{uuid.uuid4().hex}"),
    ]
    code = PRINT_UID + (
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, exc.errno)\n"
    )
    try:
        result = box.run(code)
        assert result.ok
        assert not any(t.exists() for t in targets), result.stdout
        assert f"refused {targets[0]}" in result.stdout
    finally:
        for t in targets:
            t.unlink(missing_ok=True)
        outside.rmdir()


def test_world_writable_directories_are_read_only_with_namespaces(box):
    if box.tier != "namespaces":
        pytest.skip("the fallback cannot stop writes into world-writable subdirectories")
    shared = Path(tempfile.mkdtemp(prefix="posttrain-test-"))
    shared.chmod(0o777)
    try:
        result = box.run(f"open({str(shared / 'pwned')!r}, 'w')")
        assert result.returncode == 1
        assert list(shared.iterdir()) == []
    finally:
        for child in shared.iterdir():
            child.unlink()
        shared.rmdir()


def test_no_connection_to_a_local_listener(box):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.3)
        port = server.getsockname()[1]
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        direct = box.run(connect + "print('connected')")
        # A subprocess is not covered by anything done inside the interpreter.
        spawned = box.run(
            "import subprocess, sys\n"
            f"r = subprocess.run([sys.executable, '-c', {connect!r}])\n"
            "print('child exit', r.returncode)\n"
        )
        with pytest.raises(socket.timeout):
            server.accept()
    assert direct.returncode == 1
    assert "connected" not in direct.stdout
    assert "PermissionError" in direct.stderr or "unreachable" in direct.stderr
    assert spawned.ok
    assert spawned.stdout == "child exit 1\n"


NEW_NAMESPACES = """
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
for name, flags in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET), ("user+net", CLONE_NEWUSER | CLONE_NEWNET)):
    print("unshare", name, libc.unshare(flags), os.strerror(ctypes.get_errno()))
nr_clone = {"x86_64": 56, "aarch64": 220}[platform.machine()]
pid = libc.syscall(nr_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0)
print("clone user", min(pid, 0), os.strerror(ctypes.get_errno()) if pid < 0 else "made one")
pid = os.fork()  # a plain fork still works
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="syscall numbers for x86_64/aarch64")
def test_no_new_namespace_can_be_made(box):
    # A user namespace would give the code every capability inside it: the namespace plan gets
    # EPERM from the kernel, the seccomp fallback from its filter (before: unshare succeeded there).
    result = box.run(NEW_NAMESPACES)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "unshare user -1 Operation not permitted",
        "unshare net -1 Operation not permitted",
        "unshare user+net -1 Operation not permitted",
        "clone user -1 Operation not permitted",
        "fork 7",
    ]


def test_python_level_socket_block_stops_direct_connections():
    helper = Helper("python")
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            server.settimeout(0.3)
            port = server.getsockname()[1]
            result = helper.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))")
            with pytest.raises(socket.timeout):
                server.accept()
        assert result.returncode == 1
        assert "PermissionError: network access is disabled" in result.stderr
    finally:
        helper.close()


@pytest.mark.skipif(not ROOT, reason="needs a file the code's uid cannot read: run as root")
def test_planted_secret_cannot_be_read(box):
    planted = Path(tempfile.mkdtemp(prefix="posttrain-test-"))
    planted.chmod(0o755)
    secret = planted / "secret.txt"
    secret.write_text("TOPSECRET-4242")
    secret.chmod(0o600)
    code = (
        f"for path in [{str(secret)!r}, '/proc/{os.getpid()}/environ', '/etc/shadow']:\n"
        "    try:\n"
        "        print(open(path).read())\n"
        "    except OSError as exc:\n"
        "        print('refused', exc.errno)\n"
    )
    try:
        result = box.run(code)
    finally:
        secret.unlink()
        planted.rmdir()
    assert result.ok
    assert result.stdout.count("refused") == 3
    assert "TOPSECRET" not in result.stdout


def test_printing_100_mb_is_cut_short(box):
    start = time.monotonic()
    result = box.run(PRINT_UID + "import sys\nsys.stdout.write('x' * 100_000_000)")
    assert time.monotonic() - start < 5
    assert result.stdout_truncated
    assert result.error == "output limit"
    assert len(result.stdout) <= 1 << 20
    assert_nothing_left(result)


def test_tests_harness_under_each_tier(box):
    result = box.tests(SOLUTION, ["assert add(1, 2) == 3", "assert add(1, 1) == 3"])
    assert (result.passed, result.total) == (1, 2)


# --- the unprivileged path and old kernels --------------------------------------------------


@pytest.mark.skipif(not ROOT, reason="switches to another uid to test the non-root path")
def _skip_unless_reachable_by_others() -> None:
    """The unprivileged helper must open the venv's interpreter and this checkout; a clone
    under a private folder (e.g. `mktemp -d`, mode 0700) puts them out of its reach."""
    for path in (Path(sys.executable), Path(sandbox.__file__)):
        for parent in path.absolute().parents:
            if not parent.stat().st_mode & 0o001:
                pytest.skip(f"{parent} is not searchable by other users (mode {oct(parent.stat().st_mode & 0o777)})")


def test_unprivileged_caller_gets_a_user_namespace():
    _skip_unless_reachable_by_others()
    helper = Helper("auto", uid=UNPRIVILEGED_UID)
    try:
        info = helper.call("isolation")
        if not info.namespaces:
            pytest.skip("unprivileged user namespaces are not allowed here")
        assert (info.network, info.per_run_uid) == ("netns", False)
        result = helper.run(
            "import os, socket\n"
            "print(os.getuid(), sorted(os.listdir('/')))\n"
            "for path in ['/etc/passwd-pwned', '/tmp/../pwned']:\n"
            "    try:\n"
            "        open(path, 'w')\n"
            "    except OSError as exc:\n"
            "        print('refused', exc.errno)\n"
            "try:\n"
            "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
            "except OSError as exc:\n"
            "    print('no network', exc.errno)\n"
        )
        assert result.ok, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].startswith(f"{UNPRIVILEGED_UID} ")
        assert lines[1:] == ["refused 30", "refused 30", "no network 101"]
        bomb = helper.run(
            "import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n",
            timeout_s=1,
            max_processes=8,
        )
        assert bomb.timed_out
        assert [p.split()[0] for p in processes_of(UNPRIVILEGED_UID)] == [str(helper.proc.pid)]
    finally:
        helper.close()


@pytest.mark.skipif(not ROOT, reason="switches to another uid to test the non-root path")
def test_unprivileged_fallback_leaves_no_process_behind():
    # No namespaces and no per-run uid: only the init, a child subreaper, can clean up.
    _skip_unless_reachable_by_others()
    helper = Helper("seccomp", uid=UNPRIVILEGED_UID)
    escape = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "        os._exit(0)\n"
    )
    try:
        left = helper.run(escape + "print('done')")
        assert left.ok
        assert left.duration_s < 4
        bomb = helper.run(
            escape + "while True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\n",
            timeout_s=1,
        )
        assert bomb.timed_out
        assert [p.split()[0] for p in processes_of(UNPRIVILEGED_UID)] == [str(helper.proc.pid)]
    finally:
        helper.close()


@pytest.mark.skipif(not ROOT, reason="needs a mount namespace")
def test_remount_readonly_for_kernels_without_mount_setattr(tmp_path):
    script = (
        "import os, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "import _sandbox_child as c\n"
        "c._unshare(c.CLONE_NEWNS)\n"
        "c._mount(None, '/', None, c.MS_REC | c.MS_PRIVATE)\n"
        "root = sys.argv[1]\n"
        "c._mount('tmpfs', root, 'tmpfs', c.MS_NODEV, 'size=1m')\n"
        "os.mkdir(root + '/sub')\n"
        "c._mount('tmpfs', root + '/sub', 'tmpfs', c.MS_NOEXEC, 'size=1m')\n"
        "c._remount_readonly(root)\n"
        "for path in (root + '/a', root + '/sub/b'):\n"
        "    try:\n"
        "        open(path, 'w')\n"
        "    except OSError as exc:\n"
        "        print(exc.errno)\n"
        "for line in open('/proc/self/mountinfo'):\n"
        "    if line.split()[4] == root + '/sub':\n"
        "        print(line.split()[5])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(Path(sandbox.__file__).parent)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    erofs_a, erofs_b, options = result.stdout.split()
    assert (erofs_a, erofs_b) == ("30", "30")  # EROFS for both mounts
    assert {"ro", "nosuid", "noexec"} <= set(options.split(","))  # noexec was kept
