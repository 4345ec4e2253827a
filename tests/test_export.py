"""`posttrain export`: checkpoints, run directories, LoRA adapters, reward models and critics
become folders that plain transformers (a fresh process without posttrain) loads with the
same outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from posttrain import RMConfig, SFTConfig, SFTTrainer
from posttrain.cli import main
from posttrain.config import LoraConfig, build_config
from posttrain.data.make_preferences import make_preferences
from posttrain.data.tasks import make_task
from posttrain.data.tokenizer import build_tokenizer
from posttrain.export import export_model, resolve_model_dir
from posttrain.models import BuiltinLM, forward_logits
from posttrain.models.heads import ScalarHeadModel
from posttrain.models.lora import apply_lora
from posttrain.trainers.reward import run_rm

IDS = [[1, 23, 60, 31, 67, 9], [1, 55, 41, 41, 72, 5]]  # BOS + bytes, no pad id inside

# A fresh Python process that never imports posttrain: for each line "CASES.json OUT.pt" on
# stdin it loads every case with plain transformers, saves the outputs, and answers "ok".
_CHECKER = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    for line in sys.stdin:
        spec, target = line.split()
        out = {}
        for case in json.load(open(spec)):
            classifier = case["kind"] == "sequence_classifier"
            cls = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
            model = cls.from_pretrained(case["dir"], local_files_only=True).eval()
            AutoTokenizer.from_pretrained(case["dir"], local_files_only=True)
            ids = torch.tensor(case["ids"])
            with torch.no_grad():
                if classifier:
                    hidden = model.model(ids).last_hidden_state
                    result = {"scores": model(ids).logits[:, 0], "values": model.score(hidden)[..., 0]}
                else:
                    result = {"logits": model(ids).logits}
            out[case["dir"]] = {k: v.float() for k, v in result.items()} | {"dtype": str(model.dtype)}
        assert not [m for m in sys.modules if m.split(".")[0] == "posttrain"], "posttrain was imported"
        torch.save(out, target)
        print("ok", flush=True)
    """
)


@pytest.fixture(scope="module")
def fresh_transformers(tmp_path_factory):
    """load(cases) -> {dir: outputs} from plain transformers in one new Python process
    (started once per module: importing torch + transformers costs seconds)."""
    workdir = tmp_path_factory.mktemp("fresh")
    stderr = open(
        workdir / "stderr.txt", "w"
    )  # a file, not a pipe: a full pipe would block the child
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHECKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=workdir,
    )
    calls = iter(range(1000))

    def load(tmp_path: Path, cases: list[tuple[Path, str]]) -> dict:
        i = next(calls)
        spec, result = tmp_path / f"cases-{i}.json", tmp_path / f"outputs-{i}.pt"
        spec.write_text(json.dumps([{"dir": str(d), "kind": k, "ids": IDS} for d, k in cases]))
        proc.stdin.write(f"{spec} {result}\n")
        proc.stdin.flush()
        answer = proc.stdout.readline().strip()
        assert answer == "ok", (workdir / "stderr.txt").read_text()[-3000:]
        return torch.load(result, weights_only=True)

    yield load
    proc.stdin.close()
    proc.wait(timeout=30)
    proc.stdout.close()
    stderr.close()


def _sft(run_dir: Path, train_file: Path, **extra) -> SFTTrainer:
    overrides = {
        "data.train_files": json.dumps([str(train_file)]),
        "data.train_batch_size": 4,
        "trainer.micro_batch_size": 4,
        "trainer.output_dir": str(run_dir),
        "trainer.max_steps": 2,
        "trainer.save_steps": 2,
        "trainer.report_to": "[]",
        "trainer.progress": False,
        **extra,
    }
    trainer = SFTTrainer(
        args=build_config(SFTConfig, None, [f"{k}={v}" for k, v in overrides.items()])
    )
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    return make_task("arithmetic", out, n_train=16, n_test=0, seed=0, difficulty="easy")["train"]


@pytest.fixture(scope="module")
def sft_run(train_file, tmp_path_factory):
    """A 2-step SFT run of the tiny built-in model: final/ and checkpoints/step-2/."""
    run = tmp_path_factory.mktemp("sft")
    torch.manual_seed(0)
    _sft(run, train_file, **{"model.init": "tiny", "trainer.learning_rate": 3e-3})
    return run


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return forward_logits(model, torch.tensor(ids)).float()


def test_run_dir_and_checkpoint_export_load_in_plain_transformers(
    sft_run, fresh_transformers, tmp_path
):
    final = export_model(sft_run, tmp_path / "final")
    assert final.source == sft_run / "final" and final.kind == "causal_lm"
    half = export_model(sft_run / "checkpoints" / "step-2", tmp_path / "bf16", dtype="bfloat16")
    for out in (final.out, half.out):
        names = {p.name for p in out.iterdir()}
        assert {
            "config.json",
            "model.safetensors",
            "generation_config.json",
            "tokenizer.json",
        } <= names
        assert json.loads((out / "config.json").read_text())["architectures"] == [
            "LlamaForCausalLM"
        ]
    got = fresh_transformers(tmp_path, [(final.out, "causal_lm"), (half.out, "causal_lm")])
    ours = _logits(BuiltinLM.from_pretrained(sft_run / "final"))
    torch.testing.assert_close(got[str(final.out)]["logits"], ours, atol=1e-4, rtol=0)
    assert got[str(half.out)]["dtype"] == "torch.bfloat16"
    # final/ and step-2 hold the same weights; bf16 rounding stays small on O(1) logits.
    torch.testing.assert_close(got[str(half.out)]["logits"], ours, atol=0.1, rtol=0.05)


def test_lora_checkpoint_merges_to_the_trained_model_or_exports_as_a_peft_adapter(
    sft_run, train_file, fresh_transformers, tmp_path
):
    base = sft_run / "final"
    run = tmp_path / "lora"
    trainer = _sft(
        run,
        train_file,
        **{"model.path": str(base), "model.lora.r": 4, "trainer.learning_rate": 1e-2},
    )
    trained = _logits(trainer.model)
    assert (
        trained - _logits(BuiltinLM.from_pretrained(base))
    ).abs().max() > 1e-3  # the adapter matters
    ckpt = run / "checkpoints" / "step-2"
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "config.json").exists()

    # The base comes from RUN_DIR/config.yaml (model.path): peft recorded none for BuiltinLM.
    merged = export_model(ckpt, tmp_path / "merged", merge_lora=True)
    assert merged.kind == "causal_lm" and merged.base == base
    got = fresh_transformers(tmp_path, [(merged.out, "causal_lm")])
    torch.testing.assert_close(got[str(merged.out)]["logits"], trained, atol=1e-4, rtol=0)

    adapter = export_model(ckpt, tmp_path / "adapter")
    assert adapter.kind == "lora_adapter" and "PeftModel.from_pretrained" in adapter.notes[0]
    config = json.loads((adapter.out / "adapter_config.json").read_text())
    assert (
        config["base_model_name_or_path"] == str(base.resolve()) and config["auto_mapping"] is None
    )
    import peft
    from transformers import AutoModelForCausalLM

    hf_base = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    with_adapter = peft.PeftModel.from_pretrained(hf_base, adapter.out).eval()
    torch.testing.assert_close(_logits(with_adapter), trained, atol=1e-4, rtol=0)


def test_reward_model_and_ppo_critic_export_as_sequence_classifiers(
    sft_run, fresh_transformers, tmp_path
):
    tok = build_tokenizer()
    policy = BuiltinLM.from_pretrained(sft_run / "final")
    torch.manual_seed(1)
    rm = ScalarHeadModel.from_causal_lm(policy)
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    # A PPO run's layout (checkpoint.RunModels): the policy in final/, the critic in final/critic/.
    ppo = tmp_path / "ppo"
    policy.save_pretrained(ppo / "final")
    tok.save_pretrained(ppo / "final")
    critic = ScalarHeadModel.from_causal_lm(policy)
    critic.save_pretrained(ppo / "final" / "critic")

    rm_out = export_model(tmp_path / "rm", tmp_path / "rm_out")
    critic_out = export_model(ppo, tmp_path / "critic_out", critic=True)
    assert critic_out.source == ppo / "final" / "critic"
    for result in (rm_out, critic_out):
        assert (
            result.kind == "sequence_classifier"
            and result.architecture == "LlamaForSequenceClassification"
        )
    assert (critic_out.out / "tokenizer.json").is_file()  # taken from final/, next to critic/
    got = fresh_transformers(
        tmp_path, [(rm_out.out, "sequence_classifier"), (critic_out.out, "sequence_classifier")]
    )
    ids = torch.tensor(IDS)
    with torch.no_grad():
        torch.testing.assert_close(
            got[str(rm_out.out)]["scores"], rm.scores(ids), atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            got[str(critic_out.out)]["values"], critic.values(ids), atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            got[str(critic_out.out)]["scores"], critic.scores(ids), atol=1e-4, rtol=0
        )


def test_reward_model_lora_checkpoint_merges_into_a_sequence_classifier(
    sft_run, fresh_transformers, tmp_path
):
    """A LoRA reward model: adapters on the backbone, the score head saved whole
    (modules_to_save); its base is the causal LM it started from."""
    make_preferences(
        "arithmetic", tmp_path / "pref", n_train=8, n_test=0, seed=0, difficulty="easy"
    )
    run = tmp_path / "rm"
    overrides = {
        "model.path": sft_run / "final",
        "model.lora.r": 4,
        "data.train_files": json.dumps([str(tmp_path / "pref" / "train.jsonl")]),
        "data.train_batch_size": 4,
        "trainer.micro_batch_size": 4,
        "trainer.output_dir": run,
        "trainer.max_steps": 2,
        "trainer.save_steps": 2,
        "trainer.learning_rate": 1e-2,
        "trainer.report_to": "[]",
        "trainer.progress": False,
    }
    run_rm(build_config(RMConfig, None, [f"{k}={v}" for k, v in overrides.items()]))
    merged = export_model(run / "checkpoints" / "step-2", tmp_path / "merged", merge_lora=True)
    assert merged.kind == "sequence_classifier" and merged.base == sft_run / "final"
    got = fresh_transformers(tmp_path, [(merged.out, "sequence_classifier")])
    with torch.no_grad():  # final/ is the trained model, merged by the trainer itself
        trained = ScalarHeadModel.from_pretrained(run / "final").scores(torch.tensor(IDS))
    torch.testing.assert_close(got[str(merged.out)]["scores"], trained, atol=1e-4, rtol=0)


def test_overwrite_replaces_atomically_and_a_failed_export_keeps_the_old_folder(sft_run, tmp_path, monkeypatch):
    import os
    import stat

    import posttrain.export as export

    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from before")
    old = os.umask(0o022)
    try:
        export_model(sft_run, out, overwrite=True)
    finally:
        os.umask(old)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # not mkdtemp's 0o700
    before = (out / "model.safetensors").read_bytes()

    def broken(*args):
        raise RuntimeError("tokenizer failed")

    monkeypatch.setattr(export, "_write_tokenizer", broken)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        export_model(sft_run / "checkpoints" / "step-2", out, dtype="bfloat16", overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .tmp-* left behind


def test_clear_errors_name_the_path(sft_run, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"nothing loadable in .*empty"):
        export_model(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"final has no critic/"):
        export_model(sft_run, tmp_path / "out", critic=True)
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        export_model(sft_run, tmp_path / "out", merge_lora=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty; pass --overwrite"):
        export_model(sft_run, tmp_path / "full")
    # An adapter over a fresh model.init base: the base weights were never saved.
    tok = build_tokenizer()
    lora = apply_lora(BuiltinLM.from_preset("tiny", vocab_size=len(tok)), LoraConfig(r=2))
    lora.save_pretrained(tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match=r"cannot find the base model .*Pass --base PATH"):
        export_model(tmp_path / "adapter", tmp_path / "out", merge_lora=True)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((sft_run / "final" / "config.json").read_text())
    with pytest.raises(ValueError, match="transformers cannot load .*broken"):
        export_model(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_cli_export(sft_run, tmp_path, capsys):
    assert main(["export", str(sft_run), "--out", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    assert "causal_lm" in out and str(sft_run / "final") in out and str(tmp_path / "e") in out
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "f")]) == 1
    assert "missing" in capsys.readouterr().err
