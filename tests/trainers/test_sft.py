"""SFT end to end on the built-in model: learning signal, run directory, exact resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain import SFTConfig, SFTTrainer
from posttrain.config import build_config
from posttrain.data.tasks import make_task
from posttrain.models import BuiltinLM


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    make_task("arithmetic", out, n_train=300, n_test=20, seed=0, difficulty="easy")
    return out


def _overrides(arith, run_dir, **extra):
    base = {
        "model.init": "tiny",
        "data.train_files": [str(arith / "train.jsonl")],
        "data.train_batch_size": 8,
        "trainer.micro_batch_size": 4,
        "trainer.output_dir": str(run_dir),
        "trainer.learning_rate": 3e-3,
        "trainer.warmup_steps": 2,
        "trainer.report_to": [],
        "trainer.progress": False,
    }
    base.update(extra)
    return [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in base.items()]


def test_sft_learns_and_writes_the_run_directory(arith, tmp_path, caplog):
    run = tmp_path / "run"
    cfg = build_config(
        SFTConfig, None, _overrides(arith, run, **{"trainer.max_steps": 30, "data.eval_files": [str(arith / "test.jsonl")]})
    )
    with caplog.at_level("INFO", logger="posttrain.trainers.sft"):
        result = SFTTrainer(args=cfg).train()
    assert "SFT: 300 examples, 30 steps of 8, " in "\n".join(caplog.messages)  # dataset rows (packing off)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3  # a real learning signal
    assert result.metrics["eval/loss"] < losses[0]
    assert rows[0]["data/n_rows"] == 300 and rows[0]["data/n_truncated"] == 0
    assert (run / "config.yaml").is_file() and (run / "final" / "config.json").is_file()
    # final/ is a plain Llama checkpoint: transformers loads it and agrees with our model.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(run / "final", local_files_only=True)
    ids = torch.tensor([tok("12+7=")["input_ids"]])
    ours = BuiltinLM.from_pretrained(run / "final")
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids), atol=1e-4)


def test_gradient_accumulation_and_checkpointing_give_the_same_weights(arith, tmp_path):
    weights = []
    for micro, checkpointing in ((8, False), (2, False), (2, True)):
        cfg = build_config(
            SFTConfig, None,
            _overrides(arith, tmp_path / f"m{micro}{checkpointing}", **{
                "trainer.max_steps": 3, "trainer.micro_batch_size": micro,
                "model.gradient_checkpointing": checkpointing}),
        )
        trainer = SFTTrainer(args=cfg)
        trainer.train()
        assert (trainer.model.model.layers[0].checkpoint_kwargs is not None) == checkpointing
        weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], atol=1e-5, rtol=1e-5)
        assert torch.equal(weights[1][k], weights[2][k])  # the same arithmetic, recomputed


def _cli(arith, run_dir, max_steps, resume="auto"):
    args = _overrides(
        arith, run_dir,
        **{"trainer.max_steps": max_steps, "trainer.save_steps": 2, "trainer.micro_batch_size": 1,
           "trainer.resume": resume, "trainer.save_total_limit": 3},
    )
    return [sys.executable, "-m", "posttrain.cli", "sft", *args]


def test_sigkill_then_resume_matches_an_uninterrupted_run(arith, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = 16
    full = tmp_path / "full"
    subprocess.run(_cli(arith, full, steps), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(arith, killed, steps), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "step-4" / "COMPLETE").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (killed / "final").exists()  # it really stopped mid-run

    subprocess.run(_cli(arith, killed, steps), check=True, env=env, capture_output=True)
    a = load_file(full / "final" / "model.safetensors")
    b = load_file(killed / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    logged = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # each step once, despite the restart


def test_missing_training_data_is_a_clear_error(tmp_path):
    cfg = build_config(SFTConfig, None, ["model.init=tiny"])
    with pytest.raises(ValueError, match="data.train_files"):
        SFTTrainer(args=cfg)
    bad = Path(tmp_path) / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "oops"\n')
    cfg = build_config(SFTConfig, None, ["model.init=tiny", f"data.train_files=[{bad}]"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        SFTTrainer(args=cfg)


def test_diverging_run_stops_cleanly_and_keeps_the_last_good_checkpoint(arith, tmp_path):
    from posttrain.training.core import TrainingDiverged

    run = tmp_path / "run"
    # An absurd learning rate: the first update overflows the weights, every later loss is
    # inf/NaN, each such step is skipped and counted, and the guard stops the run.
    cfg = build_config(
        SFTConfig, None,
        _overrides(arith, run, **{"trainer.max_steps": 10, "trainer.learning_rate": 1e30, "trainer.warmup_steps": 0,
                                  "trainer.max_grad_norm": 0, "trainer.max_bad_steps": 3, "trainer.save_steps": 1}),
    )
    with pytest.raises(TrainingDiverged, match=r"3 consecutive steps.*last good checkpoint is at .*step-1"):
        SFTTrainer(args=cfg).train()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["nonfinite_steps"] >= 1  # skipped steps are counted in the metrics
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]  # none from bad steps


def test_max_time_s_ends_the_run_like_max_steps(arith, tmp_path):
    # A budget that is spent by the first step: the run stops there, and still evaluates,
    # checkpoints and writes final/, as at max_steps.
    run = tmp_path / "run"
    cfg = build_config(SFTConfig, None, _overrides(arith, run, **{
        "trainer.max_steps": 50, "trainer.max_time_s": 1e-6, "data.eval_files": [str(arith / "test.jsonl")],
    }))
    result = SFTTrainer(args=cfg).train()
    assert result.step == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1] and "eval/loss" in rows[-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    assert (run / "final" / "config.json").is_file()
    with pytest.raises(Exception, match="trainer.max_time_s"):
        build_config(SFTConfig, None, ["trainer.max_time_s=0"])
