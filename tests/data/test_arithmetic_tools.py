"""The tool-use task: demonstrations that call the calculator, the no-tool variant, the
scorer, and SFT masking of the environment's results in those demonstrations."""

import json
import random

import pytest

from posttrain.cli import main
from posttrain.data.collate import (
    IGNORE_INDEX,
    split_environment_text,
    tokenize_dataset,
    tokenize_example,
)
from posttrain.data.sources import load_rows
from posttrain.data.tasks import ArithmeticToolsTask, get_task, make_task
from posttrain.data.tasks.arithmetic_tools import HINT, pairs_of
from posttrain.data.tokenizer import build_tokenizer

MARKERS = ("<result>", "</result>")


def train_rows(out_dir, seed, **options):
    """The 2000 training rows `make_task` writes for these options into `out_dir`."""
    info = make_task("arithmetic_tools", out_dir, n_train=2000, n_test=100, seed=seed, **options)
    return [json.loads(line) for line in info["train"].read_text().splitlines()]


def test_a_demonstration_calls_the_calculator_on_each_product_then_on_their_sum():
    task = ArithmeticToolsTask()
    assert task.demonstration([(23, 47), (58, 91)]) == (
        "<call>calculator(23*47)</call><result>1081</result>"
        "<call>calculator(58*91)</call><result>5278</result>"
        "<call>calculator(1081+5278)</call><result>6359</result>\nAnswer: 6359"
    )
    assert ArithmeticToolsTask(use_tools=False).demonstration([(23, 47), (58, 91)]) == "Answer: 6359"


def test_rows_follow_the_options_and_score_one():
    rows = get_task("arithmetic_tools", difficulty="hard").generate(50, random.Random(0))
    task = ArithmeticToolsTask(difficulty="hard")
    for r in rows:
        terms = r["prompt"][:-1].split("+")
        assert len(terms) == 3 and all(len(x) == 3 for t in terms for x in t.split("*"))
        assert r["completion"].count("<call>") == 4 and task.score(r["completion"], r["answer"]) == 1.0
    assert task.score("<result>6359</result>\nAnswer: 6358", "6359") == 0.0
    assert task.score("Answer: 6359\n<call>calculator(1)</call>", "6359") == 0.0  # not the last line


@pytest.mark.parametrize("options", [{"terms": 1}, {"digits": 0}, {"digits": (3, 2)}, {"use_tools": "yes"}])
def test_invalid_options_are_rejected(options):
    with pytest.raises(ValueError):
        ArithmeticToolsTask(**options)


def test_split_environment_text():
    assert split_environment_text("a<result>4</result>b<result>5</result>", MARKERS) == [
        ("a", True), ("<result>4</result>", False), ("b", True), ("<result>5</result>", False)]
    assert split_environment_text("a<result>4", MARKERS) == [("a<result>4", True)]
    assert split_environment_text("a<result>4</result>", ()) == [("a<result>4</result>", True)]


def test_sft_trains_on_the_calls_and_the_answer_never_on_the_results():
    tok = build_tokenizer()
    row = {"prompt": "23*47+58*91=", "completion": ArithmeticToolsTask().demonstration([(23, 47), (58, 91)])}
    ex = tokenize_example(row, tok, "prompt_completion", environment_markers=MARKERS)
    ids, labels = ex["input_ids"], ex["labels"]
    assert ids == tokenize_example(row, tok, "prompt_completion")["input_ids"]  # bytes: the same tokens
    text = "".join(tok.decode([i]) for i, lab in zip(ids, labels) if lab != IGNORE_INDEX)
    assert text == ("<call>calculator(23*47)</call><call>calculator(58*91)</call>"
                    "<call>calculator(1081+5278)</call>\nAnswer: 6359" + tok.eos_token)
    with pytest.raises(ValueError, match="environment_markers"):
        tokenize_example(row, tok, "prompt_completion", environment_markers=("<result>",))


def test_data_make_writes_tool_demonstrations_that_sft_masks(tmp_path):
    assert main(["data", "make", "arithmetic_tools", "--out", str(tmp_path), "--n-train", "20",
                 "--n-test", "5", "difficulty=easy"]) == 0
    rows = load_rows(str(tmp_path / "train.jsonl"))
    assert len(rows) == 20 and all(r["task"] == "arithmetic_tools" and "<call>calculator(" in r["completion"]
                                   for r in rows)
    examples, _ = tokenize_dataset(rows, build_tokenizer(), environment_markers=MARKERS)
    tok = build_tokenizer()
    for ex in examples:
        trained = tok.decode([i for i, lab in zip(ex["input_ids"], ex["labels"]) if lab != IGNORE_INDEX])
        assert "<result>" not in trained and "</call>" in trained


def test_tool_fraction_calls_the_calculator_in_that_share_of_the_same_problems(tmp_path):
    full, part = train_rows(tmp_path / "full", 3), train_rows(tmp_path / "part", 3, tool_fraction=0.3)
    none = train_rows(tmp_path / "none", 3, use_tools=False)
    assert [r["prompt"] for r in full] == [r["prompt"] for r in part] == [r["prompt"] for r in none]
    calls = [r["completion"].startswith("<call>") for r in part]
    assert 0.25 < sum(calls) / len(calls) < 0.35
    for r, f, b, c in zip(part, full, none, calls):
        assert r["completion"] == (f["completion"] if c else b["completion"])
    meta = json.loads((tmp_path / "part" / "task.json").read_text())
    assert meta["options"]["tool_fraction"] == 0.3
    assert "tool_fraction" not in json.loads((tmp_path / "full" / "task.json").read_text())["options"]
    with pytest.raises(ValueError, match="tool_fraction"):
        ArithmeticToolsTask(tool_fraction=1.5)


def test_hinted_training_prompts_always_call_and_other_splits_are_never_hinted(tmp_path):
    info = make_task("arithmetic_tools", tmp_path / "h", n_train=2000, n_test=100, n_rl=100, seed=1,
                     tool_fraction=0.15, hinted=0.5)
    split = {k: [json.loads(line) for line in info[k].read_text().splitlines()] for k in ("train", "test", "rl")}
    hinted = [r for r in split["train"] if r["prompt"].startswith(HINT)]
    assert 0.45 < len(hinted) / 2000 < 0.55
    assert all(r["completion"].startswith("<call>calculator(") for r in hinted)
    r = hinted[0]
    pairs = pairs_of(r["prompt"])
    assert r["completion"].endswith(f"Answer: {sum(a * b for a, b in pairs)}") and r["answer"] == str(sum(a * b for a, b in pairs))
    plain = [r for r in split["train"] if not r["prompt"].startswith(HINT)]
    assert 0.08 < sum(r["completion"].startswith("<call>") for r in plain) / len(plain) < 0.22
    assert not any(r["prompt"].startswith(HINT) for k in ("test", "rl") for r in split[k])
    # The held-out problems are those of the unhinted task with the same seed.
    same = make_task("arithmetic_tools", tmp_path / "u", n_train=2000, n_test=100, n_rl=100, seed=1)
    assert same["test"].read_text().splitlines()[0].split('"completion"')[0] == \
        info["test"].read_text().splitlines()[0].split('"completion"')[0]


def test_sum_call_fraction_keeps_the_product_calls_and_adds_in_the_head_in_the_rest(tmp_path):
    full, part = train_rows(tmp_path / "full", 4), train_rows(tmp_path / "part", 4, sum_call_fraction=0.3)
    assert [r["prompt"] for r in full] == [r["prompt"] for r in part]
    task = ArithmeticToolsTask()
    summed = 0
    for f, r in zip(full, part):
        pairs = pairs_of(r["prompt"])
        assert r["completion"].count("<call>") in (len(pairs), len(pairs) + 1)
        summed += r["completion"].count("<call>") == len(pairs) + 1
        assert r["completion"] == task.demonstration(pairs, sum_call=r["completion"] == f["completion"])
        assert task.score(r["completion"], r["answer"]) == 1.0
    assert 0.25 < summed / len(part) < 0.35
    assert task.demonstration([(23, 47), (58, 91)], sum_call=False) == (
        "<call>calculator(23*47)</call><result>1081</result>"
        "<call>calculator(58*91)</call><result>5278</result>\nAnswer: 6359")
    assert json.loads((tmp_path / "part" / "task.json").read_text())["options"]["sum_call_fraction"] == 0.3
    assert "sum_call_fraction" not in json.loads((tmp_path / "full" / "task.json").read_text())["options"]
    with pytest.raises(ValueError, match="sum_call_fraction"):
        ArithmeticToolsTask(sum_call_fraction=-0.1)


def test_product_call_fraction_works_the_first_product_out_in_the_head_in_the_rest(tmp_path):
    full, part = train_rows(tmp_path / "full", 4), train_rows(tmp_path / "part", 4, product_call_fraction=0.3)
    assert [r["prompt"] for r in full] == [r["prompt"] for r in part]
    task, called = ArithmeticToolsTask(), 0
    for f, r in zip(full, part):
        pairs = pairs_of(r["prompt"])
        called += r["completion"] == f["completion"]
        assert r["completion"] == task.demonstration(pairs, product_call=r["completion"] == f["completion"])
        assert r["completion"].count("<call>") == len(pairs) + (r["completion"] == f["completion"])
        assert task.score(r["completion"], r["answer"]) == 1.0
    assert 0.25 < called / len(part) < 0.35
    assert task.demonstration([(23, 47), (58, 91)], product_call=False) == (
        "23*47=1081\n<call>calculator(58*91)</call><result>5278</result>"
        "<call>calculator(1081+5278)</call><result>6359</result>\nAnswer: 6359")
    assert json.loads((tmp_path / "part" / "task.json").read_text())["options"]["product_call_fraction"] == 0.3
    with pytest.raises(ValueError, match="product_call_fraction"):
        ArithmeticToolsTask(product_call_fraction=1.5)
