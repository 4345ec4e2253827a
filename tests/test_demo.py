"""`posttrain demo --quick`: one run of the whole pipeline (data → SFT → eval → RL → eval →
table → report) at a tiny size; every stage must leave its outputs where DESIGN.md says."""

import contextlib
import io
import json
import re

import pytest

from posttrain.cli import main
from posttrain.demo import QUICK


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(OUT, rc, stdout) of one `posttrain demo --quick` run."""
    out = tmp_path_factory.mktemp("demo") / "run"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["demo", "--quick", "--out", str(out), "--device", "cpu"])
    return out, rc, stdout.getvalue()


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_demo_exits_cleanly(demo):
    _, rc, _ = demo
    assert rc == 0


def test_data_stage_writes_the_task(demo):
    out, _, _ = demo
    assert len(jsonl(out / "data" / "train.jsonl")) == QUICK.n_train
    test = jsonl(out / "data" / "test.jsonl")
    assert len(test) == QUICK.n_test and {"prompt", "answer"} <= test[0].keys()


@pytest.mark.parametrize("run, steps", [("sft", QUICK.sft_steps), ("rl", QUICK.rl_steps)])
def test_training_stages_write_run_directories(demo, run, steps):
    out, _, _ = demo
    run_dir = out / run
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (run_dir / "final" / name).is_file(), name
    assert (run_dir / "config.yaml").is_file()
    assert jsonl(run_dir / "metrics.jsonl")[-1]["step"] == steps


def test_both_evaluations_score_the_same_problems(demo):
    out, _, _ = demo
    evals = {s: json.loads((out / f"eval_{s}" / "eval.json").read_text()) for s in ("sft", "rl")}
    samples = {s: jsonl(out / f"eval_{s}" / "samples.jsonl") for s in ("sft", "rl")}
    for s in ("sft", "rl"):
        assert evals[s]["metrics"]["num_prompts"] == QUICK.n_test
        assert evals[s]["settings"]["temperature"] == 0.0
        assert len(samples[s]) == QUICK.n_test
    assert [r["prompt"] for r in samples["sft"]] == [r["prompt"] for r in samples["rl"]]
    assert evals["sft"]["settings"]["model"].endswith("sft/final")
    assert evals["rl"]["settings"]["model"].endswith("rl/final")


def test_report_has_the_plots_inlined(demo):
    out, _, _ = demo
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2
    assert list(out.glob("report-*.png"))


def test_summary_holds_the_canonical_fields(demo):
    out, _, _ = demo
    summary = json.loads((out / "summary.json").read_text())
    evals = {s: json.loads((out / f"eval_{s}" / "eval.json").read_text())["metrics"] for s in ("sft", "rl")}
    assert summary["sft_accuracy"] == evals["sft"]["accuracy"]
    assert summary["rl_accuracy"] == evals["rl"]["accuracy"]
    assert summary["gain"] == pytest.approx(summary["rl_accuracy"] - summary["sft_accuracy"])
    assert 0.0 <= summary["sft_accuracy"] <= 1.0 and 0.0 <= summary["rl_accuracy"] <= 1.0
    stages = summary["stage_seconds"]
    assert set(stages) == {"data", "sft", "eval_sft", "rl", "eval_rl", "report"}
    assert sum(stages.values()) <= summary["wall_seconds"] + 1.0
    assert summary["quick"] is True and summary["device"] == "cpu" and summary["seed"] == 0
    assert summary["paths"]["model"] == str(out / "rl" / "final")
    assert summary["paths"]["report"] == str(out / "report.html")


def test_prints_the_table_and_ends_with_where_things_are(demo):
    out, _, stdout = demo
    assert re.search(r"after SFT\s+after RL\s+change", stdout)
    for row in ("accuracy", "mean length (tokens)", "mean reward"):
        assert re.search(rf"^{re.escape(row)}\s+\S+\s+\S+\s+[+-]", stdout, re.M), row
    assert stdout.rstrip().splitlines()[-2:] == [f"model:  {out / 'rl' / 'final'}", f"report: {out / 'report.html'}"]


def test_refuses_a_directory_with_other_files(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 1
    assert "notes.txt" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_help_says_what_it_does_and_where_outputs_go(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--quick" in out and "summary.json" in out and "rl/final" in out
