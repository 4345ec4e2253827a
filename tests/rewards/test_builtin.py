"""Built-in reward functions on hand-checked examples."""

from __future__ import annotations

import importlib.util
import json
import random
import time

import pytest

from posttrain.data.tasks import get_task
from posttrain.rewards import (
    BUILTIN_REWARDS,
    RewardRunner,
    builtin,
    code_tests,
    completion_text,
    exact_match,
    extract_code,
    extract_final_answer,
    format_reward,
    math_accuracy,
    overlong_penalty,
    resolve_reward,
    task_reward,
)

# ---------------------------------------------------------------- answer extraction


def test_completion_text_reads_strings_and_conversations():
    assert completion_text("hi") == "hi"
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"
    assert (
        completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}])
        == "b"
    )
    assert completion_text([]) == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 6*7 = 42. Answer: 42", "42"),
        ("The answer is 7.\nThe answer is 8.", "8."),  # the last one
        (r"thus \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{1} then \boxed{2}", "2"),
        ("<think>Answer: 1</think><answer> 42 </answer>", "42"),
        ("<think>Answer: 1</think>\nAnswer: 3", "3"),  # reasoning inside <think> is skipped
        ("no final answer here", None),
        (r"\boxed{unclosed", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


# ---------------------------------------------------------------- math_accuracy


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (r"so \boxed{1/2}", "0.5", 1.0),  # equivalent forms
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"The answer is $\frac{1}{2}$.", "1/2", 1.0),
        ("Answer: 42", "42", 1.0),
        ("6 times 7 is 42", "42", 1.0),  # no stated answer: the last number
        ("42 is not it, it is 41", "42", 0.0),
        ("Answer: 41", "42", 0.0),
        (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # gold without $...$ is parsed as LaTeX too
        ("<think>maybe 3</think><answer>4</answer>", "4", 1.0),
        ("no idea", "42", 0.0),
        ("Answer: " + "9" * 2000, "9", 0.0),  # too long to be a final answer
    ],
)
def test_math_accuracy(completion, gold, expected):
    assert math_accuracy([completion], answer=[gold]) == [expected]


def test_math_accuracy_conversational_none_gold_and_text_fallback():
    completions = [[{"role": "assistant", "content": r"\boxed{3}"}], "x", "Answer: Paris."]
    # None gold: not applicable; a gold math-verify cannot parse is compared as text
    assert math_accuracy(completions, answer=["3", None, "paris"]) == [1.0, None, 1.0]


# ---------------------------------------------------------------- exact_match, format_reward


def test_exact_match_normalises():
    completions = ["The answer is  New   York.", "Answer: $42$", "paris", "Answer: Lyon", "x"]
    answers = ["new york", "42", "Paris.", "Paris", None]
    assert exact_match(completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, None]


def test_format_reward_default_and_custom_pattern():
    reward = format_reward()
    completions = [
        "<think>\nstep 1\nstep 2\n</think>\n<answer>42</answer>",  # multi-line: DOTALL
        "  <think>a</think><answer>b</answer>\n",  # surrounding whitespace is stripped
        "<answer>42</answer>",  # no think block
        "<think>a</think><answer>b</answer> trailing",
    ]
    assert reward(completions) == [1.0, 1.0, 0.0, 0.0]
    assert format_reward(r".*\\boxed\{.+\}")(["so \\boxed{3}", "3"]) == [1.0, 0.0]


# ---------------------------------------------------------------- overlong_penalty


def test_overlong_penalty_values():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then −(L − 6)/4, −1 beyond 10
    reward = overlong_penalty(max_len=10, buffer_len=4)
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 12)]
    assert reward(completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(10, 4, penalty=0.5)(completion_ids=[[0] * 8]) == [-0.25]
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(max_len=4, buffer_len=8)
    with pytest.raises(ValueError, match="completion_ids"):
        reward(completions=["x"], completion_ids=None)


# ---------------------------------------------------------------- task_reward


def test_task_reward_on_arithmetic_rows():
    rows = get_task("arithmetic", difficulty="easy").generate(4, random.Random(0))
    reward = task_reward(task="arithmetic")
    prompts = [r["prompt"] for r in rows]
    answers = [r["answer"] for r in rows]
    right = [r["completion"] for r in rows]
    wrong = [f"Answer: {int(a) + 1}" for a in answers]
    assert reward(prompts, right, answer=answers) == [1.0] * 4
    assert reward(prompts, wrong, answer=answers) == [0.0] * 4


def test_task_reward_reads_the_task_column():
    reward = task_reward()
    out = reward(
        ["37+85*2=", "Use 3 7 25 to make 96:", "free text"],
        ["Answer: 207", "Answer: (25+7)*3", "anything"],
        answer=["207", "96", None],
        task=["arithmetic", "countdown", None],  # None: not applicable
        numbers=[None, [3, 7, 25], None],
        completion_ids=None,
    )
    assert out == [1.0, 1.0, None]
    with pytest.raises(ValueError, match="`task` column"):
        reward(["p"], ["Answer: 1"], answer=["1"])
    with pytest.raises(ValueError, match="unknown task 'arithmetc'"):
        task_reward(task="arithmetc")


@pytest.fixture
def fresh_scorers():
    builtin._scorer.cache_clear()
    yield
    builtin._scorer.cache_clear()


def test_reasoning_gym_missing_gives_install_hint(monkeypatch, fresh_scorers):
    monkeypatch.setitem(__import__("sys").modules, "reasoning_gym", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[tasks\]'"):
        task_reward(task="rg:leg_counting")


needs_reasoning_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="reasoning_gym not installed (pip install 'posttrain[tasks]')",
)


@needs_reasoning_gym
def test_reasoning_gym_scorer_rebuilds_the_entry_from_the_row(fresh_scorers):
    """The real package's verifier gets {question, answer, metadata} back from the row's
    columns; metadata may be a dict or, as `data make rg:<name>` writes it, a JSON string."""
    import reasoning_gym

    e1, e2, e3 = reasoning_gym.create_dataset("leg_counting", size=3, seed=0)
    reward = task_reward()
    out = reward(
        [e1["question"], e2["question"], e3["question"]],
        [
            f"<think>{e1['answer']}?</think><answer>{e1['answer']}</answer>",  # the tag wins
            f"counting...\nAnswer: {e2['answer']}",
            "Answer: a few",
        ],
        answer=[e1["answer"], e2["answer"], e3["answer"]],
        task=["rg:leg_counting"] * 3,
        metadata=[json.dumps(e1["metadata"]), e2["metadata"], e3["metadata"]],  # JSON or dict
    )
    assert out == [1.0, 1.0, 0.0]


@needs_reasoning_gym
def test_reasoning_gym_real_dataset(fresh_scorers):
    import reasoning_gym

    entry = reasoning_gym.create_dataset("leg_counting", size=1, seed=0)[0]
    out = task_reward(task="rg:leg_counting")(
        [entry["question"]],
        [f"<answer>{entry['answer']}</answer>"],
        answer=[entry["answer"]],
        metadata=[entry["metadata"]],
    )
    assert out == [1.0]


# ---------------------------------------------------------------- code_tests


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```python\na = 1\n```\n```python\nb = 2\n```", "b = 2\n"),  # the last python block
        ("```python\na = 1\n```\n```\nc = 3\n```", "a = 1\n"),  # python beats plain
        ("```\nc = 3\n```", "c = 3\n"),
        ("def f(): pass", "def f(): pass"),  # no fence: the whole text
    ],
)
def test_extract_code(text, expected):
    assert extract_code(text) == expected


DOUBLE = "Here you go:\n```python\ndef double(x):\n    return 2 * x\n```"
TESTS = ["assert double(1) == 2", "assert double(2) == 4", "assert double(3) == 7"]


def test_code_tests_counts_passing_tests():
    out = code_tests([DOUBLE, DOUBLE, "x = 1"], tests=[TESTS, "\n".join(TESTS[:2]), None])
    assert out[0] == pytest.approx(2 / 3)  # the third assert is wrong
    assert out[1] == 1.0  # a string of asserts
    assert out[2] is None  # no tests: not applicable


def test_code_tests_infinite_loop_scores_zero_within_the_timeout():
    start = time.monotonic()
    out = code_tests(
        ["def double(x):\n    while True:\n        pass"], tests=[TESTS], timeout_s=1.0
    )
    assert out == [0.0]
    assert time.monotonic() - start < 5.0


def test_code_tests_bad_test_fails_only_its_row_in_the_runner():
    name, fn = resolve_reward({"name": "code_tests", "timeout_s": 2.0})
    assert name == "code_tests" and fn.keywords == {"timeout_s": 2.0}
    result = RewardRunner([(name, fn)], failure_reward=-1.0).score(
        ["p", "p"], [DOUBLE, DOUBLE], None, {"tests": [TESTS[:2], ["assert ("]]}
    )
    assert result.per_function["code_tests"] == [1.0, -1.0]
    assert result.metrics["reward/code_tests/errors"] == 1.0
    with pytest.raises(ValueError, match="no option memory"):
        resolve_reward({"name": "code_tests", "memory": 1})


def test_every_builtin_is_registered():
    assert set(BUILTIN_REWARDS) == {
        "math_accuracy",
        "exact_match",
        "format_reward",
        "overlong_penalty",
        "task_reward",
        "code_tests",
        "llm_judge",
        "reward_model",
        "env_reward",
    }


def brevity(completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]


def test_describe_reward_gives_the_spec_that_loads_a_python_callable_again(tmp_path):
    """How config.yaml records reward functions passed from Python (`describe_reward`): a
    built-in by name, a factory's function with its options, a top-level function of an
    importable module or of a file by module:function / file.py:function, and no spec for what
    cannot be loaded by name (a lambda, a callable object)."""
    from posttrain.rewards import format_reward, math_accuracy
    from posttrain.rewards.registry import describe_reward, load_object, resolve_reward

    assert describe_reward(math_accuracy)["spec"] == "math_accuracy"
    assert describe_reward(format_reward(pattern="^a"))["spec"] == {"name": "format_reward", "pattern": "^a"}
    assert describe_reward(format_reward())["spec"] == "format_reward"
    assert describe_reward(resolve_reward({"name": "code_tests", "timeout_s": 2.0})[1])["spec"] == {
        "name": "code_tests", "timeout_s": 2.0}
    mine = describe_reward(brevity)
    assert mine == {"name": "brevity", "callable": f"{__name__}:brevity", "file": __file__,
                    "spec": f"{__name__}:brevity"}
    path = tmp_path / "my_rewards.py"
    path.write_text("def short(completions, **kw):\n    return [0.0] * len(completions)\n")
    by_file = describe_reward(load_object(f"{path}:short"))
    assert by_file["spec"] == f"{path}:short" and load_object(by_file["spec"]) is load_object(f"{path}:short")
    assert describe_reward(lambda completions, **kw: [0.0])["spec"] is None
    judge_like = describe_reward(RewardObject())
    assert judge_like["spec"] is None and judge_like["callable"].endswith(":RewardObject instance")
    assert describe_reward("exact_match") == {"name": "exact_match", "spec": "exact_match"}


class RewardObject:
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)
