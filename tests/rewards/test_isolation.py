"""User reward code that crashes: a module that fails or exits as it loads is one line; a
function that calls sys.exit is a failure in either isolation; under reward.isolation=process
os._exit, a segfault and a hang are failures too, the run goes on and the worker is replaced."""

import json
import textwrap
import time

import pytest

from posttrain.cli import main
from posttrain.rewards.registry import resolve_reward
from posttrain.rewards.runner import RewardRunner
from posttrain.user_code import UserCodeError

CRASHY = textwrap.dedent('''
    import ctypes, os, sys, time

    def fine(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def exits(completions, **kwargs):
        sys.exit(4)

    def dies_on_batches(completions, **kwargs):
        if len(completions) > 1:
            os._exit(9)
        return [1.0]

    def segfaults(completions, **kwargs):
        ctypes.string_at(0)

    def hangs(completions, **kwargs):
        time.sleep(30)

    def counts(completions, log_metric, **kwargs):
        log_metric("seen", len(completions))
        return [0.5] * len(completions)

    def divides(completions, **kwargs):
        return [1 / 0 for _ in completions]
''')
EXITS_LINE = 8  # sys.exit(4)


@pytest.fixture
def crashy(tmp_path):
    path = tmp_path / "crashy.py"
    path.write_text(CRASHY)
    return lambda name: resolve_reward(f"{path}:{name}")


@pytest.mark.parametrize("source", ["import sys\nsys.exit(4)\n", "x = 1 / 0\n", "def f(:\n"])
def test_a_module_that_exits_or_fails_as_it_loads_is_one_line(tmp_path, monkeypatch, source):
    (tmp_path / "bad_rewards.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    for spec, what in [(f"{tmp_path / 'bad_rewards.py'}:f", f"the file '{tmp_path / 'bad_rewards.py'}'"),
                       ("bad_rewards:f", "the module 'bad_rewards'")]:
        with pytest.raises(UserCodeError, match=rf"^{what} raised \w+: .* at {tmp_path / 'bad_rewards.py'}:\d"):
            resolve_reward(spec)


def test_a_name_that_is_not_callable_is_one_line(tmp_path):
    (tmp_path / "rewards.py").write_text("threshold = 0.5\n")
    with pytest.raises(ValueError, match=rf"^reward '{tmp_path / 'rewards.py'}:threshold' is 0.5 \(float\), not a function"):
        resolve_reward(f"{tmp_path / 'rewards.py'}:threshold")  # the CLI prints a ValueError as one line


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_sys_exit_in_a_reward_function_is_a_failure_not_the_end(crashy, isolation):
    runner = RewardRunner([crashy("fine"), crashy("exits")], timeout_s=5.0, failure_reward=-1.0, isolation=isolation)
    try:
        result = runner.score(["p"] * 2, ["a", "bb"])
    finally:
        runner.close()
    assert result.per_function == {"fine": [1.0, 2.0], "exits": [-1.0, -1.0]}
    assert result.metrics["reward/exits/errors"] == 2.0
    assert runner.first_failure("exits").startswith(
        "failed on sample 0 (per-sample retry): SystemExit: 4 at ")
    assert f"crashy.py:{EXITS_LINE} (in exits)" in runner.first_failure("exits")  # the user's line, from either


def test_a_worker_that_dies_is_a_failure_and_is_replaced(crashy):
    runner = RewardRunner([crashy(n) for n in ("fine", "dies_on_batches", "segfaults", "counts", "divides")],
                          timeout_s=5.0, failure_reward=-1.0, isolation="process")
    try:
        result = runner.score(["p"] * 3, ["a", "bb", "ccc"])
        assert result.per_function["fine"] == [1.0, 2.0, 3.0]
        assert result.per_function["dies_on_batches"] == [1.0, 1.0, 1.0]  # killed on the batch, fine per sample
        assert result.per_function["segfaults"] == result.per_function["divides"] == [-1.0] * 3
        assert result.metrics["reward/counts/seen"] == 3.0  # log_metric crosses the process boundary
        assert [result.metrics[f"reward/{n}/errors"] for n in ("dies_on_batches", "segfaults", "divides")] == [0, 3, 3]
        assert "died (killed by SIGSEGV)" in runner.first_failure("segfaults")
        assert runner.first_failure("divides").splitlines()[0].startswith(
            "failed on sample 0 (per-sample retry): ZeroDivisionError: division by zero at ")
        assert "crashy.py:" in runner.first_failure("divides").splitlines()[0]  # the user's file, not cloudpickle's
        assert runner.pool.replaced == 1 + 1 + 3  # the batch os._exit, the segfaults
        again = runner.score(["p"], ["a"])  # the run goes on, on fresh workers
        assert again.per_function["fine"] == [1.0] and again.per_function["dies_on_batches"] == [1.0]
        procs = [w.proc for w in runner.pool._idle]
    finally:
        runner.close()
    assert procs and all(p.poll() is not None for p in procs)  # closed: every worker ended


def test_a_hung_worker_is_killed_at_the_timeout_and_replaced(crashy):
    runner = RewardRunner([crashy("fine"), crashy("hangs")], timeout_s=1.0, failure_reward=-1.0, isolation="process")
    try:
        result = runner.score(["p"] * 2, ["a", "bb"])
        # a timeout, whichever deadline fired first (the runner's or the worker's): no per-sample retry
        assert runner.first_failure("hangs").startswith("timed out after 1.0 s on a batch of 2"), runner.first_failure("hangs")
        assert result.per_function == {"fine": [1.0, 2.0], "hangs": [-1.0, -1.0]}
        assert result.metrics["reward/hangs/errors"] == 2.0
        deadline = time.monotonic() + 2
        while runner.pool.replaced < 1 and time.monotonic() < deadline:  # the waiting thread kills it
            time.sleep(0.02)
        assert runner.pool.replaced == 1
    finally:
        runner.close()


def test_a_function_that_does_not_pickle_is_refused_by_name():
    import threading

    lock = threading.Lock()

    def locked(completions, **kwargs):
        with lock:
            return [0.0] * len(completions)

    with pytest.raises(ValueError, match="reward function 'locked' cannot be sent to a worker process"):
        RewardRunner([("locked", locked)], isolation="process")


def test_reward_isolation_reaches_the_runner_and_built_ins_stay_in_the_trainer(crashy):
    from posttrain.config import GRPOConfig
    from posttrain.trainers.rl_build import build_reward

    cfg = GRPOConfig()
    cfg.reward.isolation = "process"
    reward = build_reward(cfg, ["exact_match", crashy("fine")[1]])
    try:
        names = {name: fn for name, fn in reward.runner.functions}
        assert names["exact_match"] is reward.runner._original["exact_match"]  # posttrain's own: in process
        assert names["fine"] is not reward.runner._original["fine"] and len(reward.runner.pool.payloads) == 1
    finally:
        reward.runner.close()


@pytest.mark.slow
def test_a_run_survives_a_reward_function_that_calls_os_exit(tmp_path, capsys):
    (tmp_path / "rewards.py").write_text("import os\n\ndef dies_on_batches(completions, **kwargs):\n"
                                         "    if len(completions) > 1:\n        os._exit(9)\n    return [1.0]\n")
    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"prompt": "p"}) + "\n")
    code = main(["grpo", "model.init=tiny", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path / 'run'}",
                 f"reward.functions=[{tmp_path / 'rewards.py'}:dies_on_batches]", "reward.isolation=process",
                 "trainer.report_to=[]", "trainer.progress=false", "trainer.max_steps=1", "data.train_batch_size=1",
                 "rollout.n=2", "actor.micro_batch_size=2", "rollout.max_new_tokens=2", "algorithm.overlong.buffer=0"])
    assert code == 0, capsys.readouterr().err  # today: the trainer exits 9 without a word
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/dies_on_batches/mean"] for m in metrics if "reward/dies_on_batches/mean" in m] == [1.0]


def test_a_worker_deadline_that_fires_before_the_runner_s_is_a_timeout_not_a_retry():
    """The race of the two deadlines (both timeout_s): the worker's WorkerTimedOut can reach the
    runner as the call's error before the runner's own wait ends. It is counted as the timeout
    it is, once per sample, with no per-sample retry (which would time out once more per row)."""
    from posttrain.rewards.isolation import WorkerTimedOut

    calls = []

    def slow(completions, **kwargs):
        calls.append(len(completions))
        raise WorkerTimedOut("not finished within 1.0 s; its worker process was killed")

    runner = RewardRunner([("slow", slow)], timeout_s=1.0, failure_reward=-1.0)
    try:
        result = runner.score(["p"] * 2, ["a", "bb"])
    finally:
        runner.close()
    assert calls == [2]  # the batch only
    assert result.per_function == {"slow": [-1.0, -1.0]} and result.metrics["reward/slow/errors"] == 2.0
    assert runner.first_failure("slow").startswith("timed out after 1.0 s on a batch of 2")
