"""reasoning-gym datasets as tasks (`rg:<name>`), with the real reasoning_gym package."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed: pip install 'posttrain[tasks]'")

from posttrain.data.tasks.reasoning_gym import make_rg_task  # noqa: E402
from posttrain.rewards import RewardRunner  # noqa: E402

TASKS = ["rg:basic_arithmetic", "rg:leg_counting"]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def score(rows, completions):
    """task_reward through the runner, exactly as an RL trainer or `posttrain eval` calls it."""
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    result = RewardRunner.from_specs(["task_reward"]).score([r["prompt"] for r in rows], completions, None, columns)
    return result.per_function["task_reward"]


@pytest.mark.parametrize("task", TASKS)
def test_rows_score_one_when_right_and_zero_when_wrong(task, tmp_path):
    info = make_rg_task(task, tmp_path, n_train=12, n_test=4, seed=0)
    train, test = read(info["train"]), read(info["test"])
    assert (len(train), len(test)) == (12, 4)
    rows = train + test
    assert {r["task"] for r in rows} == {task}
    assert all(r["prompt"].startswith(r["question"].rstrip()) and "Answer:" in r["prompt"] for r in rows)
    assert score(rows, [r["completion"] for r in rows]) == [1.0] * 16  # "Answer: <answer>"
    assert score(rows, [f"Let me think.\nAnswer: {r['answer']}" for r in rows]) == [1.0] * 16
    assert score(rows, ["Answer: banana" for r in rows]) == [0.0] * 16
    assert score(rows, ["no final answer here" for r in rows]) == [0.0] * 16


def test_splits_are_disjoint_deterministic_and_test_ignores_n_train(tmp_path):
    a = make_rg_task("rg:basic_arithmetic", tmp_path / "a", n_train=20, n_test=5, seed=1, max_terms=3)
    b = make_rg_task("rg:basic_arithmetic", tmp_path / "b", n_train=20, n_test=5, seed=1, max_terms=3)
    c = make_rg_task("rg:basic_arithmetic", tmp_path / "c", n_train=40, n_test=5, seed=1, max_terms=3)
    assert a["train"].read_bytes() == b["train"].read_bytes()
    assert a["test"].read_bytes() == b["test"].read_bytes() == c["test"].read_bytes()
    train, test = read(a["train"]), read(a["test"])
    questions = [r["question"] for r in train + test]
    assert len(set(questions)) == 25
    assert all(json.loads(r["metadata"])["num_terms"] <= 3 for r in train + test)  # max_terms=3
    meta = json.loads(a["task"].read_text())
    assert meta["name"] == "rg:basic_arithmetic" and meta["options"]["max_terms"] == 3
    assert meta["seed"] == 1 and meta["source"].startswith("reasoning-gym ")


def test_small_space_is_deduplicated_or_reported(tmp_path):
    # One or two of a single kind of animal: 74 distinct questions, so 60 need deduplication.
    opts = dict(min_animals=1, max_animals=1, min_instances=1, max_instances=2)
    info = make_rg_task("rg:leg_counting", tmp_path, n_train=50, n_test=10, seed=0, **opts)
    assert len({r["question"] for r in read(info["train"]) + read(info["test"])}) == 60
    with pytest.raises(ValueError, match="too few distinct questions: found 74 of the 100"):
        make_rg_task("rg:leg_counting", tmp_path, n_train=90, n_test=10, seed=0, **opts)


def test_tag_format_asks_for_answer_tags(tmp_path):
    info = make_rg_task("rg:leg_counting", tmp_path, n_train=0, n_test=3, answer_format="tag")
    rows = read(info["test"])
    assert all("<answer></answer>" in r["prompt"] and r["completion"] == f"<answer>{r['answer']}</answer>" for r in rows)
    assert score(rows, [f"<think>count</think><answer>{r['answer']}</answer>" for r in rows]) == [1.0] * 3


def test_unknown_dataset_lists_close_names(tmp_path):
    with pytest.raises(ValueError, match=r"did you mean: rg:basic_arithmetic"):
        make_rg_task("rg:basic_arithmetc", tmp_path)


def test_unknown_or_invalid_option_names_the_options(tmp_path):
    with pytest.raises(ValueError, match=r"no option max_term.*max_terms"):
        make_rg_task("rg:basic_arithmetic", tmp_path, n_test=1, max_term=3)
    with pytest.raises(ValueError, match="rejects options"):
        make_rg_task("rg:basic_arithmetic", tmp_path, n_test=1, min_terms=5, max_terms=2)
    with pytest.raises(ValueError, match="answer_format"):
        make_rg_task("rg:basic_arithmetic", tmp_path, n_test=1, answer_format="json")


def test_missing_package_gives_the_install_hint(monkeypatch, tmp_path):
    for module in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        monkeypatch.setitem(sys.modules, module, None)  # import fails, as when not installed
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[tasks\]'"):
        make_rg_task("rg:basic_arithmetic", tmp_path)
