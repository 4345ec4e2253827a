"""The one training loop, as every command sees it: the same checkpoint rules (a checkpoint is
only ever a good state; a run of bad steps stops, naming the last good one), exact resume,
and the reference sync (TR-DPO) with its checkpoints.

Each command runs on a tiny built-in model. Faults are injected by wrapping the real
`train_step` so that chosen optimizer steps see a NaN loss (the real loss, times NaN).
"""

import json
import shutil

import pytest
import torch
import yaml

from posttrain import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    PPOConfig,
    PPOTrainer,
    RewardTrainer,
    RMConfig,
    SFTConfig,
    SFTTrainer,
)
from posttrain.config import ConfigError, LoraConfig, build_config
from posttrain.data.sources import rows_sha256
from posttrain.models import BuiltinLM
from posttrain.models.lora import apply_lora
from posttrain.training.core import TrainingDiverged
from posttrain.workers import Reference
from posttrain.workers import actor as actor_module

PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(4) for b in range(4)]
TEXTS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(4)]
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]


def tiny_lm(tok, seed=0):
    torch.manual_seed(seed)
    return BuiltinLM.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
    )


def starts_with_digit(prompts, completions, completion_ids, **columns):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def alternating(prompts, completions, completion_ids, **columns):
    """1, 0, 1, 0, ...: every group of rollout.n = 4 has a spread, whatever a random model samples,
    so every GRPO step has advantages to learn from (starts_with_digit can give a group, or a
    whole step, equal rewards on one CPU and not on another)."""
    return [float(i % 2) for i in range(len(completions))]


def overrides(run_dir, **extra):
    base = {"trainer.output_dir": str(run_dir), "trainer.report_to": [], "trainer.progress": False,
            "trainer.learning_rate": 1e-3, "trainer.lr_scheduler": "constant", "trainer.max_steps": 4,
            "data.train_batch_size": 4, "trainer.save_total_limit": 0}
    base.update(extra)
    return [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in base.items()]


def offline(cls, config_class, rows, **extra):
    def make(tok, run_dir, model=None, callbacks=None, **over):
        cfg = build_config(config_class, None, overrides(run_dir, **{"trainer.micro_batch_size": 2, **extra, **over}))
        return cls(model if model is not None else tiny_lm(tok), args=cfg, train_dataset=rows, processing_class=tok,
                   callbacks=callbacks)
    return make


def rl(cls, config_class, **extra):
    def make(tok, run_dir, model=None, reward=starts_with_digit, callbacks=None, **over):
        opts = {"rollout.n": 4, "rollout.max_new_tokens": 3, "actor.micro_batch_size": 8, **extra, **over}
        cfg = build_config(config_class, None, overrides(run_dir, **opts))
        return cls(model if model is not None else tiny_lm(tok), reward_funcs=[reward], args=cfg,
                   train_dataset=PROMPTS, processing_class=tok, callbacks=callbacks)
    return make


COMMANDS = {
    "sft": offline(SFTTrainer, SFTConfig, TEXTS),
    "rm": offline(RewardTrainer, RMConfig, PAIRS),
    "dpo": offline(DPOTrainer, DPOConfig, PAIRS),
    "grpo": rl(GRPOTrainer, GRPOConfig),
    "ppo": rl(PPOTrainer, PPOConfig, **{"rollout.n": 1, "actor.micro_batch_size": 4}),
}


def poison(monkeypatch, module, bad_calls):
    """NaN losses in the `bad_calls`-th calls (1-based) of `module.train_step`."""
    real, calls = module.train_step, [0]

    def wrapped(model, micro_batches, loss_fn, *args, **kwargs):
        calls[0] += 1
        if calls[0] in bad_calls:
            def nan_loss(m, mb):
                loss, n, metrics = loss_fn(m, mb)
                return loss * float("nan"), n, metrics
            return real(model, micro_batches, nan_loss, *args, **kwargs)
        return real(model, micro_batches, loss_fn, *args, **kwargs)

    monkeypatch.setattr(module, "train_step", wrapped)


def train_step_module(command):
    """Where the command's optimizer step is called: the loop (SFT/RM/DPO) or the actor (RL)."""
    from posttrain.trainers import loop

    return actor_module if command in ("grpo", "ppo") else loop


def checkpoints(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


def metric_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_step_is_counted_and_never_checkpointed(tok, tmp_path, monkeypatch, command):
    poison(monkeypatch, train_step_module(command), {2})
    trainer = COMMANDS[command](tok, tmp_path / "run", **{"trainer.save_steps": 1})
    trainer.train()
    assert checkpoints(tmp_path / "run") == ["step-1", "step-3", "step-4"]
    lines = {m["step"]: m for m in metric_lines(tmp_path / "run")}
    assert [lines[s]["nonfinite_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_steps_in_a_row_stop_the_run_naming_the_last_good_checkpoint(tok, tmp_path, monkeypatch, command):
    poison(monkeypatch, train_step_module(command), set(range(2, 100)))
    trainer = COMMANDS[command](tok, tmp_path / "run", **{"trainer.save_steps": 1, "trainer.max_bad_steps": 2})
    with pytest.raises(TrainingDiverged, match=r"2 consecutive steps at step 3.*step-1"):
        trainer.train()
    assert checkpoints(tmp_path / "run") == ["step-1"]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_resume_continues_exactly(tok, tmp_path, command):
    full = COMMANDS[command](tok, tmp_path / "full", **{"trainer.save_steps": 2})
    full.train()
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "checkpoints" / "step-4")
    shutil.rmtree(cut / "final")
    resumed = COMMANDS[command](tok, cut, **{"trainer.save_steps": 2})
    resumed.train()
    a, b = weights(full.model), weights(resumed.model)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)
    assert [m["step"] for m in metric_lines(cut)] == [1, 2, 3, 4]
    # Every command's config.yaml records the rows the Python API gave it (`config.inputs`).
    given = yaml.safe_load((cut / "config.yaml").read_text())["python_api"]["train_dataset"]
    rows = {"sft": TEXTS, "rm": PAIRS, "dpo": PAIRS}.get(command, PROMPTS)
    assert given == {"type": "list", "rows": len(rows), "sha256": rows_sha256(rows)}


# ---------------------------------------------------------------------------- reference sync


def test_sync_mixes_the_policy_into_the_reference():
    torch.manual_seed(0)
    policy, ref_model = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    before = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref = Reference(ref_model.requires_grad_(False))
    ref.sync(policy, 0.25)
    for name, p in policy.state_dict().items():
        torch.testing.assert_close(ref_model.state_dict()[name], 0.25 * p + 0.75 * before[name], atol=1e-15, rtol=0)
    assert ref.synced and ref.saved_model() is ref_model


SYNCED = {
    "dpo": {"algorithm.ref_sync_steps": 2, "algorithm.ref_sync_alpha": 0.5},
    "grpo": {"algorithm.ref_sync_steps": 2, "algorithm.ref_sync_alpha": 0.5, "algorithm.kl.in_loss": "true",
             "algorithm.kl.coef": 0.1},
}


@pytest.mark.parametrize("command", list(SYNCED))
def test_the_reference_after_a_sync_is_the_mix_of_policy_and_initial_reference(tok, tmp_path, command):
    model = tiny_lm(tok)
    initial = weights(model)
    trainer = COMMANDS[command](tok, tmp_path / "run", model=model, **SYNCED[command], **{"trainer.max_steps": 2})
    trainer.train()
    ref = trainer.reference.saved_model().state_dict()
    for name, p in trainer.model.state_dict().items():
        torch.testing.assert_close(ref[name], 0.5 * p + 0.5 * initial[name], atol=1e-6, rtol=1e-6)
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "reference" / "model.safetensors").is_file()


@pytest.mark.parametrize("command", list(SYNCED))
def test_resume_restores_the_synced_reference_exactly(tok, tmp_path, command):
    opts = {**SYNCED[command], "algorithm.ref_sync_steps": 1, "trainer.save_steps": 2,
            **({"reward": alternating} if command == "grpo" else {})}  # the policy must move for the check below
    full = COMMANDS[command](tok, tmp_path / "full", **opts)
    full.train()
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "checkpoints" / "step-4")
    shutil.rmtree(cut / "final")
    resumed = COMMANDS[command](tok, cut, **opts)
    resumed.train()
    a, b = weights(full.reference.saved_model()), weights(resumed.reference.saved_model())
    assert any(not torch.equal(a[k], weights(tiny_lm(tok))[k]) for k in a)  # it did move
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)


def test_sync_is_refused_with_lora_before_training(tok, tmp_path):
    lora = apply_lora(tiny_lm(tok), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = COMMANDS["dpo"](tok, tmp_path / "run", model=lora, **{"algorithm.ref_sync_steps": 2})
    with pytest.raises(ConfigError, match="ref_sync_steps.*LoRA"):
        trainer.train()
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("command,extra,message", [
    ("dpo", {"algorithm.precompute_ref_log_probs": "true"}, "precomputed"),
    ("grpo", {}, "no reference to sync without a KL term"),
])
def test_sync_without_a_reference_model_is_a_config_error(tok, tmp_path, command, extra, message):
    with pytest.raises(ConfigError, match=message):
        COMMANDS[command](tok, tmp_path / "run", **{"algorithm.ref_sync_steps": 2, **extra})


def overflow(monkeypatch, module, bad_calls):
    """An infinite learning rate in the `bad_calls`-th calls (1-based) of `module.train_step`:
    the loss and gradient stay finite, the update makes the weights ±inf."""
    real, calls = module.train_step, [0]

    def wrapped(model, micro_batches, loss_fn, optimizer, *args, **kwargs):
        calls[0] += 1
        if calls[0] in bad_calls:
            for group in optimizer.param_groups:
                group["lr"] = float("inf")
        return real(model, micro_batches, loss_fn, optimizer, *args, **kwargs)

    monkeypatch.setattr(module, "train_step", wrapped)


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_an_update_that_overflows_the_weights_stops_the_run_before_it_is_saved(tok, tmp_path, monkeypatch, command):
    """Issue #31 item 2: `trainer.learning_rate=inf` turned every trained weight to ±inf in an
    update whose loss and gradient were finite, the next losses were NaN, and the run exited 0
    with that model in final/. The update is checked: the run stops at once."""
    run = tmp_path / "run"
    overflow(monkeypatch, train_step_module(command), {2})
    extra = {"reward": alternating} if command == "grpo" else {}  # every RL step has a gradient
    trainer = COMMANDS[command](tok, run, **extra, **{"trainer.save_steps": 1})
    with pytest.raises(TrainingDiverged, match=r"the optimizer step at step 2 made weights NaN/inf .*"
                                               r"the last good checkpoint is at .*step-1"):
        trainer.train()
    assert checkpoints(run) == ["step-1"] and not (run / "final").exists()
    lines = metric_lines(run)
    assert [m["step"] for m in lines] == [1]
