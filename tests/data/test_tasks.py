"""Synthetic tasks: answer extraction, scorers, generators, registry and `make_task` files."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data.tasks import (
    TASKS,
    ArithmeticTask,
    CountdownTask,
    extract_answer,
    get_task,
    make_task,
    score_completions,
)
from posttrain.data.tasks.arithmetic import solve
from posttrain.data.tasks.countdown import evaluate_expression

# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("Answer: 207", "207"),
        ("85*2=170\n37+170=207\nAnswer: 207", "207"),
        ("Answer: 1\nAnswer: 2", "2"),  # the last one counts
        ("Answer:   -5  \n\n", "-5"),
        ("Answer: 207<|eos|>", "207"),
        ("Answer: 207<|eos|><|pad|><|pad|>", "207"),
        ("Answer: 207</s>", "207"),
        ("Answer: 5<|eos|>Answer: 6", "5"),  # text after the stop token is not the response
        ("Answer: 12 or 13", "12 or 13"),  # extracted whole, so the scorer can reject it
        ("no answer here", None),
        ("", None),
        ("Answer:", None),
        ("Answer:   \n", None),
        ("Answer:\n207", None),  # the value must be on the answer line
        ("Answer: 207\nand then some", None),  # the answer line must be the last one
        ("answer: 207", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


# ---------------------------------------------------------------- arithmetic


def test_solve_follows_precedence_with_one_step_per_line():
    assert solve([37, 85, 2], ["+", "*"]) == (207, ["85*2=170", "37+170=207"])
    # 5-3*2-4: the product first, then left to right; negatives carry into the next step.
    assert solve([5, 3, 2, 4], ["-", "*", "-"]) == (-5, ["3*2=6", "5-6=-1", "-1-4=-5"])
    assert solve([2, 3, 4], ["*", "*"]) == (24, ["2*3=6", "6*4=24"])


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("85*2=170\n37+170=207\nAnswer: 207", "207", 1.0),
        ("Answer: +207", "207", 1.0),
        ("Answer: 207.0", "207", 1.0),
        ("Answer:  207 \n", "207", 1.0),
        ("Answer: 207<|eos|>", "207", 1.0),
        ("Answer: -5", "-5", 1.0),
        ("Answer: 208", "207", 0.0),
        ("Answer: -207", "207", 0.0),
        ("Answer: 207a", "207", 0.0),
        ("Answer: 207.5", "207", 0.0),
        ("Answer: 2.07e2", "207", 0.0),
        ("Answer: 12 or 13", "12", 0.0),
        ("Answer: 1,207", "1207", 0.0),
        ("Answer: ٢٠٧", "207", 0.0),  # Arabic-Indic digits: int() would take them
        ("37+85*2=207", "207", 0.0),
        ("Answer: 207\n!!!", "207", 0.0),
        ("\x00\xff garbage", "207", 0.0),
        ("Answer: " + "9" * 5000, "207", 0.0),  # past int()'s digit limit: 0, not an exception
    ],
)
def test_arithmetic_score(completion, answer, expected):
    assert ArithmeticTask().score(completion, answer) == expected


def _operands(prompt: str) -> list[int]:
    return [int(x) for x in re.findall(r"[0-9]+", prompt)]


def test_arithmetic_rows_are_right_and_formatted():
    rows = ArithmeticTask(difficulty="harder").generate(300, random.Random(0))
    for row in rows:
        assert re.fullmatch(r"[0-9]+([-+*][0-9]+)+=", row["prompt"])
        assert int(row["answer"]) == eval(row["prompt"][:-1])  # our own digits-and-operators string
        lines = row["completion"].split("\n")
        assert lines[-1] == f"Answer: {row['answer']}"
        assert len(lines) - 1 == len(_operands(row["prompt"])) - 1  # one step per operator
    assert any(int(row["answer"]) < 0 for row in rows)


def test_arithmetic_two_operands_give_just_the_answer_line():
    row = ArithmeticTask(num_operands=2).generate(1, random.Random(0))[0]
    assert row["completion"] == f"Answer: {row['answer']}"


def test_arithmetic_options_change_the_output():
    rng = random.Random(0)
    one_digit = ArithmeticTask(digits=1, num_operands=4).generate(200, rng)
    assert all(x < 10 for row in one_digit for x in _operands(row["prompt"]))
    assert all(len(_operands(row["prompt"])) == 4 for row in one_digit)
    sums = ArithmeticTask(operators="+").generate(200, rng)
    assert all(set(re.sub(r"[0-9]", "", row["prompt"])) <= {"+", "="} for row in sums)
    # Factors of products are capped by mul_digits, other operands by digits.
    for row in ArithmeticTask(digits=3, mul_digits=1, operators="*").generate(200, rng):
        assert all(x < 10 for x in _operands(row["prompt"]))
    assert (
        max(
            x
            for row in ArithmeticTask(digits=3, operators="+-").generate(200, rng)
            for x in _operands(row["prompt"])
        )
        >= 100
    )


def test_explicit_options_override_the_preset():
    task = ArithmeticTask(difficulty="harder", digits=1)
    assert task.options == {
        "difficulty": "harder",
        "digits": 1,
        "mul_digits": 2,
        "operators": "+-*",
        "num_operands": [3, 4],
        "worked": 1.0,
    }
    assert task.mul_digits == 1  # capped at digits
    assert ArithmeticTask(operators="*+").options["operators"] == "+*"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_difficulty_presets_differ(name):
    by_level = {
        level: get_task(name, difficulty=level).generate(300, random.Random(0))
        for level in ("easy", "medium", "hard")
    }
    assert get_task(name).options["difficulty"] == "medium"
    mean_len = {
        level: sum(len(r["completion"]) for r in rows) / len(rows)
        for level, rows in by_level.items()
    }
    assert mean_len["easy"] < mean_len["medium"] < mean_len["hard"]


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("arithmetic", {"operators": "+/"}),
        ("arithmetic", {"operators": ""}),
        ("arithmetic", {"num_operands": 5}),
        ("arithmetic", {"num_operands": (3, 2)}),
        ("arithmetic", {"digits": 0}),
        ("arithmetic", {"difficulty": "extreme"}),
        ("countdown", {"num_numbers": 1}),
        ("countdown", {"max_number": 1}),
        ("countdown", {"difficulty": "Easy"}),
    ],
)
def test_invalid_options_are_rejected(name, options):
    with pytest.raises(ValueError):
        get_task(name, **options)


# ---------------------------------------------------------------- countdown


@pytest.mark.parametrize(
    ("expr", "numbers", "expected"),
    [
        ("(25+7)*3", [3, 7, 25], 96),
        ("( 25 + 7 ) * 3", [3, 7, 25], 96),
        ("25+7", [3, 7, 25], 32),  # a subset of the numbers is fine
        ("3*3", [3, 3, 7], 9),  # a repeated number may be used as often as it is given
        ("20*9/18", [9, 18, 20], 10),
        ("(3-7)*(2-25)", [2, 3, 7, 25], 92),  # negative intermediates are allowed
        ("3*3", [3, 7, 25], None),  # a number used twice
        ("4*25", [3, 7, 25], None),  # a number not given
        ("7/(3-3)", [3, 3, 7], None),  # division by zero
        ("7/2*4", [2, 4, 7], None),  # inexact division, even though the total is 14
        ("7//2", [2, 7], None),
        ("2**3", [2, 3], None),
        ("-3+10", [3, 10], None),  # no unary minus
        ("3.0*7", [3, 7], None),
        ("0x19", [25], None),
        ("2_5", [25], None),
        ("(25+7)*3 = 96", [3, 7, 25], None),
        ("()", [3], None),
        ("3 7", [3, 7], None),
        ("(" * 60 + "3" + ")" * 60, [3], None),  # over the length cap
        ("__import__('os').getcwd()", [3], None),
    ],
)
def test_evaluate_expression(expr, numbers, expected):
    assert evaluate_expression(expr, numbers) == expected


def test_countdown_injection_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    for expr in (
        f"__import__('pathlib').Path('{marker}').touch()",
        f"(lambda: open('{marker}', 'w'))()",
    ):
        assert CountdownTask().score(f"Answer: {expr}", "96", numbers=[3, 7, 25]) == 0.0
    assert not marker.exists()


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("25+7=32\n32*3=96\nAnswer: (25+7)*3", 1.0),
        ("Answer: 3*(7+25)<|eos|>", 1.0),
        ("Answer: 25*3+7", 0.0),  # valid but 82
        ("Answer: 96", 0.0),  # the answer is an expression, not the target
        ("25+7=32\n32*3=96", 0.0),  # no answer line
        ("Answer: (25+7)*3\nAnswer: (25+7)*3*3", 0.0),
        ("lorem ipsum", 0.0),
    ],
)
def test_countdown_score(completion, expected):
    assert CountdownTask().score(completion, "96", numbers=[3, 7, 25]) == expected


def test_countdown_score_needs_numbers():
    with pytest.raises(ValueError, match="numbers"):
        CountdownTask().score("Answer: 3*32", "96")


def test_countdown_rows_are_solvable_with_their_own_steps():
    task = CountdownTask(difficulty="hard")
    for row in task.generate(300, random.Random(0)):
        numbers, target = row["numbers"], int(row["answer"])
        assert row["prompt"] == f"Use {' '.join(map(str, numbers))} to make {target}:"
        assert numbers == sorted(numbers) and target not in numbers
        assert 1 <= target <= task.max_target
        *steps, last = row["completion"].split("\n")
        assert len(steps) == len(numbers) - 1  # the built solution uses every number
        for step in steps:
            a, op, b, value = re.fullmatch(r"([0-9]+)([-+*/])([0-9]+)=([0-9]+)", step).groups()
            assert 0 < int(value) <= task.max_target
            assert op in "+-" or b != "1"  # no step that leaves the value unchanged
        assert evaluate_expression(last.removeprefix("Answer: "), numbers) == target


def test_countdown_options_change_the_output():
    rows = CountdownTask(num_numbers=4, max_number=5, max_target=50).generate(200, random.Random(0))
    assert all(len(r["numbers"]) == 4 and max(r["numbers"]) <= 5 for r in rows)
    assert all(int(r["answer"]) <= 50 for r in rows)
    assert {len(r["numbers"]) for r in CountdownTask().generate(200, random.Random(0))} == {3, 4}


# ---------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    name=st.sampled_from(sorted(TASKS)),
    difficulty=st.sampled_from(["easy", "medium", "hard"]),
)
def test_generated_completions_score_one(seed, name, difficulty):
    task = get_task(name, difficulty=difficulty)
    rows = task.generate(40, random.Random(seed))
    assert [task.score(r["completion"], r["answer"], **r) for r in rows] == [1.0] * 40


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_scorers_never_raise_on_arbitrary_text(text):
    for completion in (text, f"Answer: {text}"):
        assert ArithmeticTask().score(completion, "7") in (0.0, 1.0)
        assert CountdownTask().score(completion, "7", numbers=[3, 4, 5]) in (0.0, 1.0)


# ---------------------------------------------------------------- registry and files


def test_unknown_task_names_the_nearest():
    with pytest.raises(
        ValueError, match=r"unknown task 'arithmetc' \(did you mean 'arithmetic'\?\)"
    ):
        get_task("arithmetc")
    with pytest.raises(ValueError, match="arithmetic, arithmetic_tools, countdown"):
        get_task("zzz")


def test_unknown_option_names_the_nearest():
    with pytest.raises(ValueError, match="did you mean 'digits'"):
        get_task("arithmetic", digit=1)


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_make_task_writes_deterministic_disjoint_splits(tmp_path, name):
    out = {
        seed_dir: make_task(name, tmp_path / seed_dir, n_train=300, n_test=50, seed=s)
        for seed_dir, s in (("a", 0), ("b", 0), ("c", 1))
    }
    for split in ("train", "test", "task"):
        assert out["a"][split].read_bytes() == out["b"][split].read_bytes()
    assert out["a"]["train"].read_bytes() != out["c"]["train"].read_bytes()

    train, test = _read_jsonl(out["a"]["train"]), _read_jsonl(out["a"]["test"])
    assert (len(train), len(test)) == (out["a"]["n_train"], out["a"]["n_test"]) == (300, 50)
    prompts = [r["prompt"] for r in train + test]
    assert len(set(prompts)) == len(prompts)
    # Rows read back from disk still verify (countdown's numbers survive as a JSON list).
    task = get_task(name)
    assert all(task.score(r["completion"], r["answer"], **r) == 1.0 for r in train + test)

    meta = json.loads(out["a"]["task"].read_text(encoding="utf-8"))
    assert meta == {
        "name": name,
        "options": task.options,
        "seed": 0,
        "counts": {"train": 300, "test": 50},
    }


def test_make_task_test_split_does_not_depend_on_n_train(tmp_path):
    small = make_task("arithmetic", tmp_path / "s", n_train=10, n_test=30, digits=1)
    big = make_task("arithmetic", tmp_path / "b", n_train=500, n_test=30, digits=1)
    assert small["test"].read_bytes() == big["test"].read_bytes()


def test_make_task_rl_split_is_disjoint_and_keeps_test_fixed(tmp_path):
    plain = make_task("arithmetic", tmp_path / "p", n_train=200, n_test=30, seed=2)
    info = make_task("arithmetic", tmp_path / "r", n_train=200, n_test=30, seed=2, n_rl=50)
    assert info["test"].read_bytes() == plain["test"].read_bytes()
    assert "rl" not in plain and not (tmp_path / "p" / "rl.jsonl").exists()
    splits = {k: _read_jsonl(info[k]) for k in ("train", "test", "rl")}
    assert {k: len(v) for k, v in splits.items()} == {"train": 200, "test": 30, "rl": 50} == {
        k: info[f"n_{k}"] for k in splits}
    prompts = [r["prompt"] for rows in splits.values() for r in rows]
    assert len(set(prompts)) == len(prompts) == 280
    assert all(r["task"] == "arithmetic" and r["answer"] for r in splits["rl"])
    assert json.loads(info["task"].read_text())["counts"] == {"test": 30, "rl": 50, "train": 200}


@pytest.mark.parametrize("worked", [0.0, 0.5, 1.0])
def test_worked_mixes_demonstrations_with_and_without_steps(worked):
    rows = ArithmeticTask(difficulty="medium", worked=worked).generate(400, random.Random(0))
    shown = sum("\n" in r["completion"] for r in rows) / len(rows)
    assert abs(shown - worked) < 0.08
    task = ArithmeticTask()
    assert all(task.score(r["completion"], r["answer"]) == 1.0 for r in rows)
    assert all(r["completion"] == f"Answer: {r['answer']}" for r in rows if "\n" not in r["completion"])


def test_worked_zero_and_one_draw_the_same_problems():
    a = ArithmeticTask(worked=1).generate(50, random.Random(3))
    b = ArithmeticTask(worked=0).generate(50, random.Random(3))
    assert [r["prompt"] for r in a] == [r["prompt"] for r in b]
    assert all("\n" in r["completion"] for r in a) and not any("\n" in r["completion"] for r in b)
    with pytest.raises(ValueError, match="worked must be a number in"):
        ArithmeticTask(worked=1.5)


def test_make_task_options_reach_the_files(tmp_path):
    paths = make_task("arithmetic", tmp_path, n_train=50, n_test=10, digits=1, operators="+")
    rows = _read_jsonl(paths["train"])
    assert all(x < 10 for r in rows for x in _operands(r["prompt"]))
    assert json.loads(paths["task"].read_text())["options"]["operators"] == "+"


def test_make_task_too_small_problem_space(tmp_path):
    # 1-digit sums of two operands: only 100 distinct prompts.
    with pytest.raises(ValueError, match=r"found 100 of the 150 requested.*`digits`"):
        make_task(
            "arithmetic", tmp_path, n_train=100, n_test=50, digits=1, operators="+", num_operands=2
        )


def test_score_completions():
    completions, answers = ["Answer: 4", "Answer: 5", "4"], ["4", "4", "4"]
    assert score_completions("arithmetic", completions, answers) == [1.0, 0.0, 0.0]
    completions, rows = (
        ["Answer: (25+7)*3", "Answer: 3*7"],
        [{"numbers": [3, 7, 25]}, {"numbers": [3, 7]}],
    )
    assert score_completions(CountdownTask(), completions, ["96", "21"], rows) == [1.0, 1.0]
    assert score_completions(CountdownTask(), completions, ["96", "96"], rows) == [1.0, 0.0]
    with pytest.raises(ValueError, match="lengths differ"):
        score_completions("arithmetic", ["Answer: 4"], ["4", "5"])
