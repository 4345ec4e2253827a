"""Issue 34, item 5: SIGKILLs of a real `posttrain grpo` run, async RL (max_staleness=1) on Ray with
a rollout pool of its own, and `trainer.resume=auto` after each: every prompt of the stream is
trained on exactly once per epoch, counted from trained_prompts.jsonl.

The kills, at points drawn from a seeded RNG (the same every run of the test):
- the driver, 5 times: 4 at a random delay after a drawn step is logged (checkpoints are written
  every step, so a kill may land mid-step or mid-save), 1 halfway through writing a checkpoint
  (POSTTRAIN_FAULT_KILL_AT=save:N, `checkpoint.files`: polling cannot hit it reliably);
- the rollout worker, twice, mid-generation (found by its process title, `ray::RLWorker.generate`):
  with trainer.on_worker_failure=restart and max_restarts=1 the run first restarts its workers by
  itself, then stops with one line naming the worker.
The local backend gets the driver kills (its rollout runs in the driver's process).

Every process a run starts (the driver, Ray's GCS, raylet, agents and workers) is in the session
the test gives it; the `sessions` fixture SIGKILLs whatever is left of each session and removes
its Ray temp folder, whatever the outcome. Slow (minutes: each run starts Ray).
"""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from posttrain.data.tasks import make_task

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "src"
PROMPTS, PER_STEP, STEPS = 16, 4, 16  # 4 steps per epoch, 4 epochs


def session_pids(sid: int) -> set[int]:
    """Live (not zombie) processes of session `sid`."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        state, _, _, session = stat[stat.rfind(")") + 2:].split()[:4]
        if int(session) == sid and state != "Z":
            found.add(int(proc.name))
    return found


def titled(sid: int, prefix: str) -> list[int]:
    """Processes of session `sid` whose command line (a Ray worker's: its title) starts with `prefix`."""
    out = []
    for pid in session_pids(sid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(prefix.encode()):
                out.append(pid)
    return out


def wait_until(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)
    return result


@pytest.fixture
def sessions(tmp_path):
    """`launch(argv, env)`: `posttrain *argv` in a session of its own (stdout and stderr into a
    file: `proc.log`). At the end every process left in those sessions is SIGKILLed (Ray's
    `ray stop`, for these runs only) and their Ray temp folders (/tmp/ptray-<pid>-*) removed."""
    started = []

    def launch(argv, env=None):
        log = tmp_path / f"run-{len(started)}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "posttrain", *argv], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), **(env or {})},
                start_new_session=True)
        proc.log = log
        started.append(proc)
        return proc

    try:
        yield launch
    finally:
        left = []
        for proc in started:
            try:
                stop_session(proc)
            except AssertionError:
                left.append(proc.pid)
        assert not left, f"processes of the runs' sessions {left} survived SIGKILL"


def stop_session(proc) -> None:
    """SIGKILL every process of `proc`'s session (again, while one is left: a raylet may still be
    starting a worker), reap it, remove its Ray temp folder."""
    def killed():
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        return not session_pids(proc.pid)

    try:
        wait_until(killed, 30, "the session's processes were not gone")
    finally:
        for tmp in Path("/tmp").glob(f"ptray-{proc.pid}-*"):
            shutil.rmtree(tmp, ignore_errors=True)


def logged_steps(run: Path) -> list[int]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        with contextlib.suppress(ValueError, KeyError):
            steps.append(json.loads(line)["step"])
    return steps


def metrics_file(run: Path) -> int | None:
    """metrics.jsonl's inode (None: no file). A resuming run cuts the file back by replacing it
    (a new inode): until then it holds the killed run's steps, which this run has not trained yet."""
    with contextlib.suppress(FileNotFoundError):
        return (run / "metrics.jsonl").stat().st_ino
    return None


def wait_for_step(proc, run: Path, step: int, stale: int | None, timeout_s: float = 600) -> None:
    """Wait until `proc`'s run has logged `step` (in a metrics.jsonl other than the `stale` one)."""
    def reached():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}:\n" + \
            proc.log.read_text()[-3000:]
        return metrics_file(run) not in (None, stale) and step in logged_steps(run)

    wait_until(reached, timeout_s, f"no metrics line of step {step}")


def kill_rollout_worker(proc) -> int:
    """SIGKILL the rollout pool's worker while it generates; its pid."""
    (pid,) = wait_until(lambda: titled(proc.pid, "ray::RLWorker.generate"), 60, "no rollout worker generating")
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_driver(proc, run: Path, step: int, rng: random.Random) -> None:
    """SIGKILL the driver at a random delay after step `step` is logged (mid-step or mid-save)."""
    wait_for_step(proc, run, step, proc.stale)
    time.sleep(rng.uniform(0.0, 1.0))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    stop_session(proc)


def kill_mid_save(proc, run: Path, step: int) -> None:
    """The run (POSTTRAIN_FAULT_KILL_AT=save:`step`) SIGKILLs itself halfway through writing step-N:
    an unsealed .tmp folder is left, never a step-N."""
    assert proc.wait(timeout=600) == -signal.SIGKILL, proc.log.read_text()[-3000:]
    stop_session(proc)
    assert list((run / "checkpoints").glob(f".tmp-step-{step}-*")), "the save was not cut halfway"
    assert not (run / "checkpoints" / f"step-{step}").exists()


def kill_rollout_twice(proc, run: Path, first_step: int, second_step: int) -> None:
    """Kill the rollout worker mid-generation after `first_step`: the run restarts its workers
    (trainer.max_restarts=1) and resumes from its checkpoint by itself; again after `second_step`:
    its restarts spent, it stops with one line naming the worker, exit 1, no process left."""
    wait_for_step(proc, run, first_step, proc.stale)
    first, stale = kill_rollout_worker(proc), metrics_file(run)
    wait_until(lambda: re.search(r"restart 1 of 1(.|\n)*resumed from", proc.log.read_text()), 300,
               "the run did not restart its workers and resume")
    out = proc.log.read_text()
    assert re.search(rf"rank 0 \(pid {first}\) of 1 \(holding rollout\) died during `generate`", out), out[-3000:]
    wait_for_step(proc, run, second_step, stale)
    second = kill_rollout_worker(proc)
    assert proc.wait(timeout=120) == 1, proc.log.read_text()[-3000:]
    out = proc.log.read_text()
    assert re.search(rf"^posttrain grpo: stopped: trainer.backend=ray: at step \d+, Ray worker rank 0 \(pid "
                     rf"{second}\) of 1 \(holding rollout\) died during `generate`", out, re.M), out[-3000:]
    assert "Traceback" not in out and "closing the rollout engines failed" not in out, out[-3000:]
    wait_until(lambda: not session_pids(proc.pid), 30, "the stopped run left a process of its own or Ray's")
    assert not list(Path("/tmp").glob(f"ptray-{proc.pid}-*")), "the stopped run left its Ray temp folder"


def resumed_step(proc) -> int:
    """The step `proc`'s run says it resumed at (waiting for the line)."""
    found = wait_until(lambda: re.search(r"resumed from \S+/step-\d+ at step (\d+)", proc.log.read_text()), 300,
                       "the run did not resume")
    return int(found.group(1))


PLANS = {  # what is killed, in order, at the drawn steps ("rollout": twice in one run, at two steps)
    "ray": ["driver", "save", "rollout", "driver", "driver", "driver"],
    "local": ["driver", "save", "driver", "driver", "driver"],
}
ON = {"ray": ["trainer.backend=ray", "placement.rollout.enable_resource_pool=true", "trainer.on_worker_failure=restart",
              "trainer.max_restarts=1"],
      "local": []}


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_sigkills_of_the_driver_and_of_a_rollout_worker_lose_and_repeat_no_prompt(tmp_path, sessions, backend):
    if backend == "ray":
        pytest.importorskip("ray")
    make_task("arithmetic", tmp_path / "data", n_train=PROMPTS, n_test=4, seed=0, difficulty="easy")
    run = tmp_path / "run"
    argv = ["grpo", "model.init=tiny", f"data.train_files=[{tmp_path / 'data' / 'train.jsonl'}]",
            f"data.train_batch_size={PER_STEP}", "rollout.n=2", "rollout.max_new_tokens=8", "actor.micro_batch_size=8",
            f"trainer.max_steps={STEPS}", "trainer.save_steps=1", "trainer.resume=auto", f"trainer.output_dir={run}",
            "trainer.report_to=[]", "trainer.progress=false", "reward.functions=[task_reward]",
            "trainer.async_training.max_staleness=1", *ON[backend]]
    plan, rng = PLANS[backend], random.Random(0)
    steps = iter(sorted(rng.sample(range(2, STEPS), len(plan) + plan.count("rollout"))))
    cut_at = None  # the step whose save was cut: the next run resumes from before it
    for what in plan:
        step = next(steps)
        stale = metrics_file(run)
        proc = sessions(argv, env={"POSTTRAIN_FAULT_KILL_AT": f"save:{step}"} if what == "save" else None)
        proc.stale = stale
        if cut_at is not None:  # resume=auto passes the unsealed step-N by
            assert resumed_step(proc) < cut_at
            cut_at = None
        if what == "save":
            kill_mid_save(proc, run, step)
            cut_at = step
        elif what == "driver":
            kill_driver(proc, run, step, rng)
        else:
            kill_rollout_twice(proc, run, step, next(steps))
    last = sessions(argv)
    assert last.wait(timeout=600) == 0, last.log.read_text()[-3000:]
    assert not list(Path("/tmp").glob(f"ptray-{last.pid}-*")), "the run left its Ray temp folder"
    assert_every_prompt_once_per_epoch(run)


def assert_every_prompt_once_per_epoch(run: Path) -> None:
    """trained_prompts.jsonl: steps 1..STEPS once each; each group's policy version within
    max_staleness=1 of its step's weights (version step - 1); each epoch's steps hold every prompt once."""
    log = [json.loads(line) for line in (run / "trained_prompts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    for r in log:
        assert len(r["prompt_index"]) == len(r["version"]) == PER_STEP, r
        assert all(0 <= r["step"] - 1 - v <= 1 for v in r["version"]), r
    per_epoch = PROMPTS // PER_STEP
    for epoch in range(STEPS // per_epoch):
        seen = Counter(i for r in log[epoch * per_epoch:(epoch + 1) * per_epoch] for i in r["prompt_index"])
        assert seen == Counter(range(PROMPTS)), (epoch, seen)
