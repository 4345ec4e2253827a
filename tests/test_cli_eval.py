"""`posttrain eval`, `posttrain generate` and `posttrain data make rg:<name>` end to end,
on a tiny built-in model saved to a temporary directory."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from posttrain.cli import main
from posttrain.data.tasks import make_task
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM

needs_rg = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="reasoning-gym not installed: pip install 'posttrain[tasks]'",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    torch.manual_seed(0)
    BuiltinLM.from_preset(
        "tiny", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    ).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def test_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    return make_task("arithmetic", out, n_train=0, n_test=3, seed=0, digits=1)["test"]


def test_eval_writes_metrics_and_one_sample_line_per_completion(model_dir, test_file, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["eval", str(model_dir), "--data", str(test_file), "--task", "arithmetic", "--n", "2",
            "--max-new-tokens", "4", "--batch-size", "2", "--out", str(out)]
    assert main(args) == 0
    summary = json.loads((out / "eval.json").read_text())
    m, settings = summary["metrics"], summary["settings"]
    assert {"accuracy", "pass@1", "pass@2", "response_length/mean", "truncation_rate", "reward/mean",
            "reward/std", "reward/min", "reward/max", "reward/task_reward/mean"} <= m.keys()
    assert settings["n"] == 2 and settings["temperature"] == 1.0  # sampled by default when n > 1
    assert settings["engine"] == "native" and settings["model"] == str(model_dir)
    assert settings["reward_specs"] == [{"name": "task_reward", "task": "arithmetic"}]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 == m["num_samples"]
    assert {"prompt", "completion", "reward", "rewards", "correct", "finish_reason", "length"} <= samples[0].keys()
    assert m["truncation_rate"] == sum(s["finish_reason"] == "length" for s in samples) / 6
    printed = capsys.readouterr().out
    assert "pass@2" in printed and str(out / "eval.json") in printed and str(out / "samples.jsonl") in printed


def test_eval_with_a_reward_file_and_a_threshold(model_dir, test_file, tmp_path, capsys):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def half(completions, **kw):\n    return [0.5] * len(completions)\n")
    base = ["eval", str(model_dir), "--data", str(test_file), "--reward", f"{rewards}:half",
            "--max-new-tokens", "2", "--num-examples", "2"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    assert "note: no reward function here (half) declares a correctness notion" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "b"), "--correct-threshold", "0.5"]) == 0
    assert "correctness notion" not in capsys.readouterr().err  # the user said what correct means
    a = json.loads((tmp_path / "a" / "eval.json").read_text())["metrics"]
    b = json.loads((tmp_path / "b" / "eval.json").read_text())["metrics"]
    assert a["num_samples"] == 2 and a["reward/half/mean"] == 0.5
    assert a["accuracy"] == 0.0 and b["accuracy"] == 1.0


def test_eval_checks_its_inputs_before_loading_a_model(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    missing_model = str(tmp_path / "no_model")
    assert main(["eval", missing_model, "--data", str(data), "--n", "0"]) == 1
    assert "--n must be >= 1" in capsys.readouterr().err
    assert main(["eval", missing_model, "--data", str(data)]) == 1
    assert "no `answer` column for math_accuracy" in capsys.readouterr().err
    assert main(["eval", missing_model, "--data", str(data), "--reward", "math_acuracy"]) == 1
    assert "did you mean 'math_accuracy'" in capsys.readouterr().err
    assert main(["eval", missing_model, "--data", str(data), "--reward", "format_reward"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_generate_prints_n_completions(model_dir, capsys):
    assert main(["generate", str(model_dir), "12+3=", "--n", "3", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" (")[0] for line in out.splitlines() if line.startswith("---")] == [
        f"--- sample {i}/3" for i in (1, 2, 3)
    ]
    assert main(["generate", str(model_dir), "hi", "--chat", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.count("--- sample") == 1


def test_generate_with_engine_hf_on_a_llama_checkpoint_matches_native(model_dir, capsys):
    """Seen: --engine hf on a Llama checkpoint failed (the built-in model has no generate());
    it now loads the model with transformers, and greedy text is the native engine's."""
    args = ["generate", str(model_dir), "12+3=", "--temperature", "0", "--max-new-tokens", "6"]
    assert main([*args, "--engine", "hf"]) == 0
    by_hf = capsys.readouterr().out
    assert main([*args, "--engine", "native"]) == 0
    assert capsys.readouterr().out == by_hf and "--- sample 1/1 (6 tokens" in by_hf


@needs_rg
def test_data_make_rg_writes_scorable_rows(tmp_path, capsys):
    out = tmp_path / "rg"
    assert main(["data", "make", "rg:chain_sum", "--out", str(out), "--n-train", "6", "--n-test", "2",
                 "max_terms=3"]) == 0
    assert "wrote 6 train and 2 test rows of rg:chain_sum" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows} == {"rg:chain_sum"} and len(rows) == 6
    assert json.loads((out / "task.json").read_text())["options"]["max_terms"] == 3


@needs_rg
def test_data_make_unknown_rg_dataset_lists_close_names(tmp_path, capsys):
    assert main(["data", "make", "rg:leg_countin", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown reasoning-gym dataset 'leg_countin'" in err and "rg:leg_counting" in err


def test_eval_default_out_is_per_model_and_never_replaced_silently(model_dir, test_file, tmp_path, monkeypatch,
                                                                    capsys):
    import shutil

    for run in ("sft_a", "sft_b"):  # two runs' final/ folders: the same name, different models
        shutil.copytree(model_dir, tmp_path / "runs" / run / "final")
    shutil.copytree(model_dir, tmp_path / "runs" / "sft_a" / "checkpoints" / "step-3")
    monkeypatch.chdir(tmp_path)
    base = ["--data", str(test_file), "--task", "arithmetic", "--max-new-tokens", "2", "--num-examples", "1"]
    for model in ("runs/sft_a/final", "runs/sft_b/final", "runs/sft_a/checkpoints/step-3"):
        assert main(["eval", model, *base]) == 0
    assert sorted(p.name for p in (tmp_path / "runs" / "eval").iterdir()) == ["sft_a", "sft_a-step-3", "sft_b"]
    assert json.loads((tmp_path / "runs/eval/sft_b/eval.json").read_text())["settings"]["model"] == "runs/sft_b/final"
    capsys.readouterr()
    # A second eval into the same folder says so and stops, unless told to replace it.
    before = (tmp_path / "runs/eval/sft_a/eval.json").read_text()
    assert main(["eval", "runs/sft_a/final", *base]) == 1
    err = capsys.readouterr().err
    assert "runs/eval/sft_a already holds an eval" in err and "--overwrite" in err
    assert (tmp_path / "runs/eval/sft_a/eval.json").read_text() == before
    assert main(["eval", "runs/sft_a/final", *base, "--overwrite"]) == 0
    assert "replaced runs/eval/sft_a/eval.json" in capsys.readouterr().out


def test_generate_output_ends_each_sample_on_its_own_line(model_dir, capsys):
    import unicodedata

    from posttrain.rollout import SamplingParams, make_engine

    args = ["12+3=", "--n", "4", "--max-new-tokens", "24", "--temperature", "1"]
    engine = make_engine("native", BuiltinLM.from_pretrained(model_dir), build_tokenizer())
    raw = engine.generate(["12+3="], SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=0)).texts
    controls = {c for t in raw for c in t if unicodedata.category(c) == "Cc"} - {"\n", "\t"}
    assert controls  # the random model writes carriage returns, escapes, ... a terminal would obey
    assert main(["generate", str(model_dir), *args]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and not {c for c in out if unicodedata.category(c) == "Cc"} - {"\n", "\t"}
    lines = out.split("\n")
    headers = [i for i, line in enumerate(lines) if line.startswith("--- sample")]
    assert len(headers) == 4 and all(b - a >= 2 for a, b in zip(headers, headers[1:]))
    assert repr(sorted(controls)[0])[1:-1] in out  # shown as an escape, not sent to the terminal


def test_eval_and_generate_take_a_run_directory_and_use_its_final_model(model_dir, test_file, tmp_path,
                                                                        monkeypatch, capsys):
    import shutil

    run = tmp_path / "runs" / "x" / "rl"
    shutil.copytree(model_dir, run / "final")
    (run / "config.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    base = ["--data", str(test_file), "--task", "arithmetic", "--max-new-tokens", "2", "--num-examples", "1"]
    assert main(["eval", "runs/x/rl", *base]) == 0
    settings = json.loads((tmp_path / "runs/eval/rl/eval.json").read_text())["settings"]
    assert settings["model"] == "runs/x/rl/final"  # what was evaluated, and the default OUT is the run's
    assert main(["generate", "runs/x/rl", "1+2=", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.count("--- sample 1/1") == 1
    # A run that has not finished: the error names the missing final/ and a checkpoint to use.
    shutil.rmtree(run / "final")
    for step in (9, 10):
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
    assert main(["generate", "runs/x/rl", "1+2="]) == 1
    err = capsys.readouterr().err
    assert "runs/x/rl is a run directory without a final model: runs/x/rl/final does not exist" in err
    assert "runs/x/rl/checkpoints/step-10" in err
    assert main(["eval", "runs/x/rl", *base]) == 1
    assert "runs/x/rl/final does not exist" in capsys.readouterr().err
