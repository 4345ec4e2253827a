"""RewardRunner: weighting, None/NaN, metrics, failures, timeouts, concurrency; the registry."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from posttrain.rewards import BUILTIN_REWARDS, RewardRunner, resolve_reward


def const(values):
    def fn(prompts, completions, completion_ids, **kwargs):
        return list(values)

    return fn


def score(runner, n=3, **columns):
    return runner.score(["p"] * n, [f"c{i}" for i in range(n)], [[1]] * n, columns)


# ---------------------------------------------------------------- combining


def test_weights_combine_and_none_is_left_out():
    runner = RewardRunner(
        [("a", const([1.0, 0.0, None])), ("b", const([0.5, None, None]))], weights=[2.0, -1.0]
    )
    result = score(runner)
    # sample 0: 2·1 − 0.5 = 1.5; sample 1: 2·0 = 0 (b says None); sample 2: all None → 0
    assert result.total.tolist() == [1.5, 0.0, 0.0]
    assert result.total.dtype == torch.float32
    assert result.per_function == {"a": [1.0, 0.0, None], "b": [0.5, None, None]}
    m = result.metrics
    assert m["reward/a/mean"] == 0.5  # mean of 1, 0: the None is not a zero
    assert m["reward/a/std"] == pytest.approx(math.sqrt(0.5))  # Bessel: ((.5²+.5²)/1)^.5
    assert m["reward/a/none_frac"] == pytest.approx(1 / 3)
    assert m["reward/b/mean"] == 0.5 and m["reward/b/std"] == 0.0  # one value
    assert m["reward/b/none_frac"] == pytest.approx(2 / 3)
    assert m["reward/mean"] == 0.5  # (1.5 + 0 + 0) / 3: all-None samples still count
    assert m["reward/std"] == pytest.approx(math.sqrt(((1.0**2) + 0.5**2 + 0.5**2) / 2))
    assert m["reward/a/errors"] == m["reward/b/errors"] == 0.0
    assert {"reward/a/time_s", "reward/hung_threads"} <= m.keys()


def test_default_weights_are_one_and_nan_means_none():
    runner = RewardRunner([("a", const([1.0, math.nan])), ("b", const([True, 2]))])
    result = score(runner, n=2)
    assert result.per_function["a"] == [1.0, None]
    assert result.per_function["b"] == [1.0, 2.0]  # bools and ints are numbers
    assert result.total.tolist() == [2.0, 2.0]


def test_all_none_function_has_nan_mean():
    result = score(RewardRunner([("a", const([None, None]))]), n=2)
    assert math.isnan(result.metrics["reward/a/mean"])
    assert result.metrics["reward/a/none_frac"] == 1.0
    assert result.total.tolist() == [0.0, 0.0]


def test_columns_arrive_as_keyword_lists():
    seen = {}

    def fn(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(
            prompts=prompts,
            completions=completions,
            ids=completion_ids,
            answer=answer,
            extra=kwargs,
        )
        return [float(c == a) for c, a in zip(completions, answer)]

    result = RewardRunner([("fn", fn)]).score(
        ["p0", "p1"], ["x", "y"], [[1], [2, 3]], {"answer": ["x", "z"], "task": ["t", "t"]}
    )
    assert result.total.tolist() == [1.0, 0.0]
    assert seen == {
        "prompts": ["p0", "p1"],
        "completions": ["x", "y"],
        "ids": [[1], [2, 3]],
        "answer": ["x", "z"],
        "extra": {"task": ["t", "t"], "trainer_state": None, "log_metric": seen["extra"]["log_metric"]},
    }  # **kwargs also takes TRL's run arguments (no trainer outside a run: trainer_state None)


def test_bad_construction_and_misaligned_columns_raise():
    with pytest.raises(ValueError, match="unique"):
        RewardRunner([("a", const([])), ("a", const([]))])
    with pytest.raises(ValueError, match="1 reward weights for 2"):
        RewardRunner([("a", const([])), ("b", const([]))], weights=[1.0])
    with pytest.raises(ValueError, match="answer has 1 entries for 2"):
        RewardRunner([("a", const([1, 1]))]).score(["p", "p"], ["x", "y"], None, {"answer": ["x"]})


# ---------------------------------------------------------------- failures


def test_raising_function_falls_back_per_sample(caplog):
    def picky(completions, **kwargs):
        if "bad" in completions:
            raise ZeroDivisionError("boom")
        return [1.0] * len(completions)

    runner = RewardRunner([("picky", picky), ("ok", const([0.5, 0.5, 0.5]))], failure_reward=-1.0)
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.runner"):
        result = runner.score(["p"] * 3, ["good", "bad", "good"], None)
    # only the sample that raises on its own gets the failure reward
    assert result.per_function["picky"] == [1.0, -1.0, 1.0]
    assert result.metrics["reward/picky/errors"] == 1.0
    assert result.total.tolist() == [1.5, -0.5, 1.5]
    assert "ZeroDivisionError: boom" in caplog.text  # traceback logged
    assert "'picky'" in caplog.text


def test_always_raising_function_fails_every_sample_and_run_goes_on():
    def broken(**kwargs):
        raise RuntimeError("always")

    runner = RewardRunner([("broken", broken), ("ok", const([1.0, 1.0]))])
    result = score(runner, n=2)
    assert result.per_function["broken"] == [0.0, 0.0]
    assert result.metrics["reward/broken/errors"] == 2.0
    assert result.total.tolist() == [1.0, 1.0]


def test_only_the_first_errors_are_logged(caplog):
    def broken(**kwargs):
        raise RuntimeError("always")

    runner = RewardRunner([("broken", broken)])
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.runner"):
        for _ in range(3):
            score(runner, n=4)
    assert len(caplog.records) == 3
    assert "only counted" in caplog.records[-1].getMessage()


@pytest.mark.parametrize(
    ("output", "what"),
    [
        ([1.0], "returned [1.0] for 2"),
        ("ab", "returned 'ab'"),
        (None, "returned None"),
        (3.0, "returned 3.0"),
    ],
)
def test_wrong_length_fails_the_batch_and_names_the_function(output, what, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.runner"):
        result = score(RewardRunner([("short", lambda **k: output)]), n=2)
    assert result.per_function["short"] == [0.0, 0.0]
    assert result.metrics["reward/short/errors"] == 2.0
    assert "'short'" in caplog.text and what in caplog.text


def test_bad_elements_fail_only_their_sample(caplog):
    runner = RewardRunner(
        [("mixed", const([1.0, "x", math.inf, ValueError("judge down"), None]))],
        failure_reward=-0.5,
    )
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.runner"):
        result = score(runner, n=5)
    assert result.per_function["mixed"] == [1.0, -0.5, -0.5, -0.5, None]
    assert result.metrics["reward/mixed/errors"] == 3.0
    assert "returned 'x' (str), not a number" in caplog.text
    assert "judge down" in caplog.text


def test_tensor_output_is_accepted():
    result = score(RewardRunner([("t", lambda **k: torch.tensor([0.25, 0.75]))]), n=2)
    assert result.per_function["t"] == [0.25, 0.75]


def test_sleeping_function_times_out_quickly():
    def sleepy(**kwargs):
        time.sleep(60)

    runner = RewardRunner(
        [("sleepy", sleepy), ("ok", const([1.0, 1.0]))], timeout_s=0.5, failure_reward=-1.0
    )
    start = time.monotonic()
    result = score(runner, n=2)
    elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 1.0
    assert result.per_function["sleepy"] == [-1.0, -1.0]
    assert result.metrics["reward/sleepy/errors"] == 2.0
    assert result.metrics["reward/hung_threads"] == 1.0
    assert result.total.tolist() == [0.0, 0.0]


def test_per_sample_retry_is_bounded_by_the_timeout():
    def raise_then_hang(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch fails")
        if completions[0] == "c1":
            time.sleep(60)
        return [1.0]

    runner = RewardRunner([("f", raise_then_hang)], timeout_s=0.3)
    start = time.monotonic()
    result = score(runner, n=3)
    assert time.monotonic() - start < 0.9  # ≤ 2 × timeout_s
    assert result.per_function["f"] == [1.0, 0.0, 1.0]
    assert result.metrics["reward/f/errors"] == 1.0


def test_hung_reward_thread_does_not_block_exit():
    code = textwrap.dedent("""
        import time
        from posttrain.rewards.runner import RewardRunner
        def hang(**kwargs):
            time.sleep(600)
        r = RewardRunner([("hang", hang)], timeout_s=0.2).score(["p"], ["c"], None)
        print(r.per_function["hang"], r.metrics["reward/hang/errors"])
    """)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[0.0]", "1.0"]
    assert time.monotonic() - start < 30  # the process exited without waiting for the sleep


def test_functions_run_concurrently():
    def slow(value):
        def fn(completions, **kwargs):
            time.sleep(0.3)
            return [value] * len(completions)

        return fn

    runner = RewardRunner([("a", slow(1.0)), ("b", slow(2.0))])
    start = time.monotonic()
    result = score(runner, n=2)
    assert time.monotonic() - start < 0.55
    assert result.total.tolist() == [3.0, 3.0]


def test_pop_metrics_of_a_function_are_logged_under_its_name():
    class Counting:
        def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)

        def pop_metrics(self):
            return {"requests": 2}

    result = score(RewardRunner([("judge", Counting())]), n=2)
    assert result.metrics["reward/judge/requests"] == 2.0


# ---------------------------------------------------------------- registry


def test_resolve_builtin_names_and_factories():
    name, fn = resolve_reward("math_accuracy")
    assert name == "math_accuracy" and fn is BUILTIN_REWARDS["math_accuracy"]
    name, fn = resolve_reward("format_reward")  # a factory with its defaults
    assert name == "format_reward"
    assert fn(["<think>x</think><answer>1</answer>", "no"]) == [1.0, 0.0]
    name, fn = resolve_reward({"name": "format_reward", "pattern": r"^\d+$"})
    assert fn(["123", "12a"]) == [1.0, 0.0]
    name, fn = resolve_reward({"name": "overlong_penalty", "max_len": 4, "buffer_len": 2})
    assert fn(completion_ids=[[0] * 3]) == [-0.5]


def test_unknown_name_suggests_the_nearest_builtin():
    with pytest.raises(
        ValueError, match=r"unknown reward 'math_acuracy' \(did you mean 'math_accuracy'"
    ):
        resolve_reward("math_acuracy")
    with pytest.raises(ValueError, match="has no option foo"):
        resolve_reward({"name": "exact_match", "foo": 1})
    with pytest.raises(ValueError, match=r"overlong_penalty.*max_len"):
        resolve_reward("overlong_penalty")  # required options missing


def test_import_path_from_a_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent("""
        def brevity(completions, **kwargs):
            return [1.0 / (1 + len(c)) for c in completions]

        def make_threshold(limit):
            def threshold(completions, **kwargs):
                return [float(len(c) <= limit) for c in completions]
            return threshold
    """)
    )
    name, fn = resolve_reward(f"{path}:brevity")
    assert name == "brevity" and fn(["abc"]) == [0.25]
    name, fn = resolve_reward({"name": f"{path}:make_threshold", "limit": 2})
    assert name == "make_threshold" and fn(["ab", "abc"]) == [1.0, 0.0]
    runner = RewardRunner.from_specs([f"{path}:brevity", "exact_match"], weights=[1.0, 1.0])
    assert score(runner, n=1, answer=["c0"]).total.tolist() == [pytest.approx(1 / 3 + 1.0)]
    with pytest.raises(ValueError, match=r"has no 'brevty'; did you mean brevity"):
        resolve_reward(f"{path}:brevty")
    with pytest.raises(ValueError, match="no such file"):
        resolve_reward(f"{tmp_path}/missing.py:brevity")


def test_import_path_from_a_module():
    name, fn = resolve_reward("posttrain.rewards.builtin:exact_match")
    assert name == "exact_match" and fn(["Answer: 4"], answer=["4"]) == [1.0]
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        resolve_reward("no_such_pkg.mod:fn")


# ---------------------------------------------------------------- what a run is told (#15)


def test_nan_is_counted_and_warned_about_once_per_function(caplog):
    runner = RewardRunner([("a", const([1.0, math.nan, math.nan])), ("b", const([math.nan, 1.0, 1.0]))])
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.runner"):
        first, second = score(runner), score(runner)
    assert first.metrics["reward/a/nan"] == 2.0 and first.metrics["reward/b/nan"] == 1.0
    assert second.metrics["reward/a/nan"] == 2.0
    warned = [r.getMessage() for r in caplog.records if "returned NaN" in r.getMessage()]
    assert len(warned) == 2  # one for a, one for b, none for the second batch
    assert warned[0].startswith("reward function 'a' returned NaN on sample 1")
    assert runner.tallies["a"].nan == 4 and runner.tallies["a"].samples == 6


def test_the_first_failure_is_kept_with_its_line_and_traceback_and_the_summary_counts_errors():
    calls = []

    def fails_on_c1(prompts, completions, completion_ids, **kwargs):
        calls.append(completions)
        if len(completions) > 1 or completions[0] == "c1":
            raise ValueError(f"cannot score {completions}")
        return [0.5]

    runner = RewardRunner([("f", fails_on_c1), ("g", const([1.0, 1.0, 1.0]))])
    assert runner.first_failure("f") is None
    score(runner)
    score(runner)
    failure = runner.first_failure("f")
    # the batch call raised too, but only the sample that really failed is a failure
    line = fails_on_c1.__code__.co_firstlineno + 3  # its `raise`
    assert failure.startswith(f"failed on sample 1 (per-sample retry): ValueError: cannot score ['c1'] at "
                              f"{fails_on_c1.__code__.co_filename}:{line} (in fails_on_c1)\nTraceback")
    assert "ValueError: cannot score ['c1']" in failure and runner.first_failure("g") is None
    assert runner.summary() == "f: 2 of 6 samples failed (33.3%), 0 NaN; g: 0 of 6 samples failed (0.0%), 0 NaN"


def test_a_wrong_length_return_is_the_first_failure_without_a_traceback():
    runner = RewardRunner([("short", const([1.0]))])
    score(runner)
    assert runner.first_failure("short") == "returned [1.0] for 3 completions; expected a list of 3 floats or None"


# ---------------------------------------------------------------- TRL's run arguments


def test_trainer_state_and_log_metric_reach_the_functions_that_take_them():
    from types import SimpleNamespace

    seen = {}

    def shaped(completions, trainer_state, log_metric, **kwargs):
        seen["step"] = trainer_state.global_step
        for c in completions:
            log_metric("len", len(c))  # logged per sample: the metric is their mean
        log_metric("calls", 1.0)
        return [1.0] * len(completions)

    def plain(prompts, completions, completion_ids, answer):  # names neither: gets neither
        return [float(a) for a in answer]

    runner = RewardRunner([("shaped", shaped), ("plain", plain)])
    runner.trainer_state = SimpleNamespace(global_step=7, epoch=0.5)
    m = runner.score(["p"] * 3, ["a", "bb", "cccccc"], [[1]] * 3, {"answer": [1, 0, 1]}).metrics
    assert seen == {"step": 7}
    assert m["reward/shaped/len"] == 3.0 and m["reward/shaped/calls"] == 1.0  # (1 + 2 + 6) / 3
    assert m["reward/plain/mean"] == pytest.approx(2 / 3) and "reward/plain/len" not in m


def test_a_per_sample_retry_still_gets_the_run_arguments():
    def fails_on_batches(completions, log_metric, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch")
        log_metric("retried", 2.0)
        return [0.5]

    m = score(RewardRunner([("f", fails_on_batches)]), n=2).metrics
    assert m["reward/f/mean"] == 0.5 and m["reward/f/retried"] == 2.0 and m["reward/f/errors"] == 0.0


def test_builtin_row_rewards_ignore_the_run_arguments():
    runner = RewardRunner.from_specs([{"name": "task_reward", "task": "arithmetic"}])
    runner.trainer_state = object()  # not a column: indexing it per row would fail every sample
    result = runner.score(["2+3="] * 2, ["Answer: 5", "Answer: 6"], [[1], [1]], {"answer": ["5", "5"]})
    assert result.metrics["reward/task_reward/errors"] == 0.0
    assert result.per_function["task_reward"][0] > result.per_function["task_reward"][1]
