"""The checks that stop a run whose reward cannot be computed: before the run (signature,
columns) and during it (a function that fails on every sample)."""

import pytest

from posttrain.rewards import RewardRunner, task_reward
from posttrain.rewards.checks import RewardFailureGuard, RewardFunctionError, check_reward_signature

# ---------------------------------------------------------------- before the run


def trl_style(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


def names_its_columns(completions, answer, prompts=None, completion_ids=None):
    return [0.0] * len(completions)


@pytest.mark.parametrize("fn", [trl_style, names_its_columns])
def test_a_function_that_takes_the_arguments_passes(fn):
    check_reward_signature("f", fn, ["answer"], "rows.jsonl")


def test_a_function_without_kwargs_is_refused_naming_what_it_does_not_take():
    def f(completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"reward function 'f'\(completions, answer\) cannot be called .* "
                                         r"\(answer\): got an unexpected keyword argument 'prompts'; .*\*\*kwargs"):
        check_reward_signature("f", f, ["answer"], "rows.jsonl")


def test_a_parameter_without_a_default_is_a_column_the_data_must_have():
    with pytest.raises(ValueError, match=r"'names_its_columns'.* needs the column 'answer', which rows.jsonl "
                                         r"does not have \(its columns: task\)"):
        check_reward_signature("names_its_columns", names_its_columns, ["task"], "rows.jsonl")


def test_task_reward_needs_a_task_column_unless_it_is_given_the_task():
    with pytest.raises(ValueError, match=r"'task_reward' needs the column 'task', which rows.jsonl does not "
                                         r"have \(its columns: answer\); .*task: arithmetic"):
        check_reward_signature("task_reward", task_reward(), ["answer"], "rows.jsonl")
    check_reward_signature("task_reward", task_reward(), ["answer", "task"], "rows.jsonl")
    check_reward_signature("task_reward", task_reward(task="arithmetic"), ["answer"], "rows.jsonl")
    with pytest.raises(ValueError, match="needs the column 'answer'"):
        check_reward_signature("task_reward", task_reward(task="arithmetic"), ["task"], "rows.jsonl")


def test_a_callable_whose_signature_cannot_be_read_is_not_refused():
    class Opaque:  # as some builtins and extension types
        __signature__ = "unreadable"

        def __call__(self, **kwargs):
            return []

    check_reward_signature("opaque", Opaque(), ["answer"], "rows.jsonl")


def test_a_builtin_that_takes_one_positional_argument_is_refused():
    with pytest.raises(ValueError, match=r"'len'\(obj, /\) cannot be called"):
        check_reward_signature("len", len, [], "rows.jsonl")


# ---------------------------------------------------------------- during the run


def broken(prompts, completions, completion_ids, **kwargs):
    raise RuntimeError("reward function bug")


def fine(prompts, completions, completion_ids, **kwargs):
    return [1.0] * len(completions)


def guard_for(max_bad_steps=3):
    runner = RewardRunner([("broken", broken), ("fine", fine)])
    runner.score(["p"] * 2, ["c"] * 2, [[1]] * 2)  # keeps broken's first traceback
    return RewardFailureGuard(runner, max_bad_steps)


def test_failing_every_sample_of_the_first_step_stops_at_once_with_the_first_traceback():
    guard = guard_for()
    with pytest.raises(RewardFunctionError) as err:
        guard.update(1, {"broken": 4.0, "fine": 0.0}, 4)
    message = str(err.value)
    assert message.startswith("reward function 'broken' failed on all 4 samples of step 1, the first of this run")
    assert "Its first failure: failed on sample 0 (per-sample retry)" in message
    assert "Traceback" in message and "RuntimeError: reward function bug" in message


def test_the_first_step_checked_is_the_first_of_a_resumed_run_too():
    with pytest.raises(RewardFunctionError, match="step 8, the first of this run"):
        guard_for().update(8, {"broken": 4.0}, 4)


def test_failing_some_samples_never_stops_the_run():
    guard = guard_for(max_bad_steps=1)
    for step in range(1, 10):
        guard.update(step, {"broken": 3.0}, 4)


def test_max_bad_steps_in_a_row_stop_it_and_a_step_with_a_score_resets_the_count():
    guard = guard_for(max_bad_steps=3)
    guard.update(1, {"broken": 1.0}, 4)
    guard.update(2, {"broken": 4.0}, 4)
    guard.update(3, {"broken": 4.0}, 4)
    guard.update(4, {"broken": 3.0}, 4)  # one sample scored: the count starts again
    guard.update(5, {"broken": 4.0}, 4)
    guard.update(6, {"broken": 4.0}, 4)
    with pytest.raises(RewardFunctionError, match=r"every sample of 3 steps in a row \(trainer.max_bad_steps=3\), "
                                                  r"up to step 7"):
        guard.update(7, {"broken": 4.0}, 4)
