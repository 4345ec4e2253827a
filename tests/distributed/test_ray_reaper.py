"""A killed driver's Ray is cleaned up (ray_reaper): the next RaySession reaps the
`ptray-<pid>-*` folders of dead runs and the processes still serving them, and the watchdog a
RaySession starts reaps its own run's folder when the driver dies. Real processes, real folders:
stand-ins for Ray's processes (a command line naming the folder, like the GCS and the raylet; a
`ray::` title with its stdout in the folder, like a worker) where Ray itself is not needed.
Every process a test starts is killed at its end, whatever the outcome."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from posttrain.distributed.ray_reaper import alive, clean_stale, start_ticks

SRC = Path(__file__).resolve().parents[2] / "src"
REAPER_DIR = SRC / "posttrain" / "distributed"
SLEEP = shutil.which("sleep")
PY = Path(sys.executable).name


def running(pid: int) -> bool:
    """`pid` is a process that is not a zombie (read from /proc, independently of ray_reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` held; fails after `timeout_s` naming `what`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def spawn():
    """`spawn(argv, **popen)`: a process killed (and reaped) when the test ends; `spawn.pids`
    takes more pids to kill (processes that are not this one's children)."""
    started, others = [], []

    def run(argv, **popen):
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, **popen)
        started.append(proc)
        return proc

    run.pids = others
    yield run
    for proc in started:
        proc.kill()
        proc.wait()
    for pid in others:
        if running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def naming(spawn, path, ignore_term=False):
    """A process whose command line names `path` (as Ray's GCS and raylet name their folder);
    `ignore_term`: one that only SIGKILL stops."""
    code = (f"import signal, time\nif {ignore_term}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print(flush=True)\ntime.sleep(60)")
    proc = spawn([sys.executable, "-S", "-c", code, str(path)], stdout=subprocess.PIPE)
    proc.stdout.readline()  # its SIGTERM handling is set
    return proc


def ray_worker(spawn, out: Path, title="ray::IDLE"):
    """A process titled like a Ray worker, its stdout in `out` (as a worker's is in its run's folder)."""
    with open(out, "w") as f:
        return spawn([title, "60"], executable=SLEEP, stdout=f)


def dead_pid(spawn) -> int:
    proc = spawn(["true"])
    proc.wait()
    return proc.pid


def test_alive_tells_the_process_from_a_reused_pid_and_a_zombie(spawn):
    me = os.getpid()
    assert alive(me) and alive(me, start_ticks(me))
    assert not alive(me, start_ticks(me) + 1)  # the pid of a process started at another time
    zombie = spawn(["true"])  # exits, and stays a zombie until waited for
    wait_for(lambda: not running(zombie.pid), 2, "true exited")
    assert Path(f"/proc/{zombie.pid}").exists() and not alive(zombie.pid)
    assert not alive(dead_pid(spawn))


def test_clean_stale_reaps_the_folders_of_dead_runs_and_what_serves_them_only(tmp_path, spawn):
    """Folders of a dead pid and of a reused pid (its process started after the folder) go, with
    the processes serving them: SIGTERM, then SIGKILL for one that ignores it. A live run's
    folder and processes, a `ray start` folder (/tmp/ray), a longer look-alike name and a
    program that is not Ray's with a file open in the dead folder are left alone."""
    dead = tmp_path / f"ptray-{dead_pid(spawn)}-a1"
    live = tmp_path / f"ptray-{os.getpid()}-b2"  # this process: a live run
    sleeper = spawn([SLEEP, "60"])
    reused = tmp_path / f"ptray-{sleeper.pid}-c3"
    user_ray = tmp_path / "ray"
    for folder in (dead, live, reused, user_ray):
        folder.mkdir()
    hour_ago = time.time() - 3600
    os.utime(reused, (hour_ago, hour_ago))  # made an hour before `sleeper` started
    gcs, stubborn = naming(spawn, dead / "session_1" / "logs"), naming(spawn, dead, ignore_term=True)
    worker = ray_worker(spawn, dead / "worker.out")
    spared = [naming(spawn, live), ray_worker(spawn, live / "worker.out"), naming(spawn, user_ray),
              naming(spawn, f"{dead}0"), ray_worker(spawn, dead / "tail.out", title="tail"), sleeper]

    said = clean_stale(tmp_path, grace_s=0.3)

    stopped = ", ".join(sorted([f"{PY} (pid {gcs.pid})", f"{PY} (pid {stubborn.pid})", f"ray::IDLE (pid {worker.pid})"]))
    assert said == (f"removed 2 Ray temp folder(s) of dead runs ({', '.join(map(str, sorted([dead, reused])))}) "
                    f"and stopped 3 Ray process(es) still serving them: {stopped}")
    assert [gcs.wait(1), stubborn.wait(1), worker.wait(1)] == [-signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, user_ray.name])
    assert [p.poll() for p in spared] == [None] * len(spared)
    assert clean_stale(tmp_path) is None


WATCHED_DRIVER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import ray_reaper
print(ray_reaper.start_watchdog(Path(sys.argv[2])).pid, flush=True)
time.sleep(60)
"""


def test_the_watchdog_reaps_its_run_when_the_driver_is_sigkilled_and_not_before(tmp_path, spawn):
    folder = tmp_path / f"ptray-{os.getpid()}-w1"
    folder.mkdir()
    # ray_reaper imported by path: the watchdog's driver needs nothing but the standard library
    driver = spawn([sys.executable, "-S", "-c", WATCHED_DRIVER, str(REAPER_DIR), str(folder)],
                   stdout=subprocess.PIPE, text=True)
    watchdog = int(driver.stdout.readline())
    spawn.pids.append(watchdog)
    raylet, worker = naming(spawn, folder / "raylet.sock"), ray_worker(spawn, folder / "worker.out")
    time.sleep(0.6)  # more than a poll of the watchdog
    assert running(watchdog) and folder.is_dir() and raylet.poll() is None and worker.poll() is None

    driver.kill()
    driver.wait()
    wait_for(lambda: not folder.exists() and not running(watchdog), 5, "the watchdog removed the folder and exited")
    assert [raylet.wait(1), worker.wait(1)] == [-signal.SIGTERM, -signal.SIGTERM]


def holders(folder: Path) -> set[int]:
    """Live processes whose command line names `folder` or which have a file open in it."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not running(int(proc.name)):
            continue
        with contextlib.suppress(OSError):
            if str(folder) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.add(int(proc.name))
                continue
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith(f"{folder}/"):
                        found.add(int(proc.name))
                        break
    return found


def session_pids(sid: int) -> set[int]:
    """Live processes of session `sid`."""
    found = set()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            stat = (proc / "stat").read_text()
            if int(stat[stat.rfind(")") + 2:].split()[3]) == sid and running(int(proc.name)):
                found.add(int(proc.name))
    return found


RAY_DRIVER = """
import logging, os, time
logging.basicConfig(level=logging.INFO)
from posttrain.distributed.ray_session import RaySession
session = RaySession(None, num_cpus=1)
def pid():
    return os.getpid()
pid = session.ray.remote(pid)
print(session.temp_dir, session.watchdog.pid, session.ray.get(pid.remote()), flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a Ray start: 5-30 s on 2 cores
def test_a_sigkilled_drivers_ray_is_gone_within_seconds_and_a_dead_runs_folder_is_reaped_at_start(tmp_path, spawn):
    """A RaySession (in a driver process of its own) first reaps a dead run's folder under /tmp and
    its process; after a SIGKILL of the driver, its watchdog stops every process that served the
    run's folder (GCS, raylet, agents, the worker) and removes the folder."""
    pytest.importorskip("ray")
    stale = Path(f"/tmp/ptray-{dead_pid(spawn)}-{uuid.uuid4().hex[:8]}")
    stale.mkdir()
    driver = None
    try:
        left_gcs = naming(spawn, stale / "session_1")
        err = tmp_path / "driver.err"
        with open(err, "w") as errf:
            driver = spawn([sys.executable, "-c", RAY_DRIVER], stdout=subprocess.PIPE, stderr=errf, text=True,
                           start_new_session=True, env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
        line = driver.stdout.readline()
        assert line, err.read_text()
        temp_dir, watchdog, worker = line.split()
        folder = Path(temp_dir)
        try:
            spawn.pids.append(int(watchdog))
            assert left_gcs.wait(5) == -signal.SIGTERM and not stale.exists()
            said = [line for line in err.read_text().splitlines() if "Ray temp folder(s) of dead runs" in line]
            assert len(said) == 1 and str(stale) in said[0], err.read_text()  # one INFO line (other dead runs' too)
            served = holders(folder) - {driver.pid}
            spawn.pids.extend(served)
            assert int(worker) in served and len(served) >= 4, served  # GCS, raylet, agents, worker, watchdog

            driver.kill()
            driver.wait()
            took = wait_for(lambda: not holders(folder) and not folder.exists(), 20,
                            f"no process serving {folder} and the folder gone")
            assert not any(running(p) for p in served), "a Ray process of the killed driver outlived it"
            print(f"the killed driver's Ray was gone {took:.1f} s after the SIGKILL")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        if driver is not None:  # whatever the driver started, if the test failed early
            spawn.pids.extend(session_pids(driver.pid))
        shutil.rmtree(stale, ignore_errors=True)


@pytest.mark.slow  # imports Ray and starts part of it: ~6 s
def test_a_failed_ray_init_leaves_no_folder_process_or_watchdog_behind():
    ray = pytest.importorskip("ray")
    from posttrain.distributed.ray_session import RaySession

    assert not ray.is_initialized()
    ours = f"/tmp/ptray-{os.getpid()}-"
    with pytest.raises(ValueError, match="nonnegative"):
        RaySession(None, num_cpus=-1)
    assert not list(Path("/tmp").glob(f"ptray-{os.getpid()}-*"))
    assert not holders_named(ours)  # its watchdog, and Ray's GCS if it got that far


def holders_named(prefix: str) -> set[int]:
    """Live processes whose command line holds `prefix` (a folder's name, whole or its start)."""
    found = set()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and prefix in (proc / "cmdline").read_bytes().decode(errors="replace") \
                    and running(int(proc.name)):
                found.add(int(proc.name))
    return found
