"""trainer.strategy=fsdp2 on trainer.backend=ray: the actor, the reference and the critic are
sharded over the workers (`distributed.fsdp`), and 2 workers give the local run's parameters
after 3 steps in float64 within 1e-10: GRPO token-mean with LoRA (the reference is the
sharded base, adapter off), GRPO seq-mean with mini-batches, the KL in the loss and a reference
synced every 2 steps, PPO with its critic. The DCP shard each worker writes holds its share.
One Ray session for the module (conftest.py)."""

import shutil
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.models import BuiltinLM

from .test_rl_ray import (
    COMPARED,
    PPO_COMPARED,
    PROMPTS,
    SETTINGS,
    TOKEN_MEANS,
    grpo_config,
    lines,
    tiny_model_f64,
    train_grpo,
)
from .words import WORDS

FSDP = {"trainer.strategy": "fsdp2"}
CASES = {
    "grpo token-mean, LoRA": {"model.lora.r": 4, "model.lora.alpha": 8, "algorithm.kl.in_loss": "true",
                              "algorithm.kl.coef": 0.1},
    "grpo seq-mean, reference synced": {**SETTINGS["reference synced every 2 steps"],
                                        "actor.policy_loss.loss_agg_mode": "seq-mean-token-mean"},
    "ppo": SETTINGS["ppo"],
}


def wide_model_f64():
    """tiny_model_f64 with 4x the layer weights (75k parameters): its shards' data outweighs
    DCP's per-tensor file overhead (~2 KB a tensor), so a file's size shows the share it holds."""
    torch.manual_seed(0)
    return BuiltinLM.from_preset("tiny", vocab_size=len(WORDS) + 3, num_hidden_layers=1, hidden_size=64,
                                 intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0).double()


def shard_bytes(run_dir: Path, step: int) -> dict[str, int]:
    """Bytes of each DCP data file (one per worker: `__<rank>_0.distcp`) of the actor's shards."""
    folder = run_dir / "checkpoints" / f"step-{step}" / "dcp" / "actor"
    return {f.name: f.stat().st_size for f in folder.glob("*.distcp")}


@pytest.mark.parametrize("name", list(CASES))
def test_two_sharded_workers_give_the_local_update(ray_session, tmp_path, name):
    wide = name.startswith("grpo seq-mean")  # the case whose shard sizes are checked
    model, over = (wide_model_f64() if wide else tiny_model_f64()), {**CASES[name], **FSDP, "trainer.save_steps": 2}
    runs = {}
    for backend in ("local", "ray"):
        ray = {"trainer.backend": "ray", "trainer.n_workers_per_node": 2} if backend == "ray" else {}
        runs[backend] = train_grpo(model, grpo_config(tmp_path / backend, **over, **ray))
    start = model.state_dict()
    for role, state in runs["local"].items():
        moved = [float((v - start[k]).abs().max()) if k in start else float(v.abs().max())  # LoRA's B starts at 0
                 for k, v in state.items() if k in start or "lora_B" in k]
        assert max(moved) > 1e-4, role
        for k, v in state.items():
            assert float((v - runs["ray"][role][k]).abs().max()) <= 1e-10, (role, k)
    seq_mean = "seq-mean" in over.get("actor.policy_loss.loss_agg_mode", "token-mean")
    keys = [k for k in COMPARED if not (seq_mean and k in TOKEN_MEANS)] + (list(PPO_COMPARED) if "cls" in over else [])
    for a, b in zip(lines(tmp_path / "local"), lines(tmp_path / "ray"), strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    one, two = shard_bytes(tmp_path / "local", 2), shard_bytes(tmp_path / "ray", 2)
    assert len(one) == 1 and len(two) == 2
    if wide:  # each worker's file holds its half of the weights and AdamW's moments
        assert max(two.values()) <= 0.6 * sum(one.values()), (one, two)


@pytest.mark.slow  # ~25 s on an idle 2-core machine (90 s at load 16); the stream itself: tests/distributed/test_weight_sync.py
def test_sharded_workers_stream_to_a_rollout_pool_and_give_the_local_update(ray_session, tmp_path):
    """2 sharded actor workers and a rollout pool of 2 (its own policy copies, generation split
    by rows): after each update both actor workers gather one parameter at a time and worker 0
    streams the buckets to the rollout workers (`PoolSync`), so the rollout samples the local
    tokens: the local run's LoRA policy after 3 steps within 1e-10. eval.task runs on a copy
    every actor worker gathers into worker 0 (no engine in the actor pool): the local eval."""
    model, name = tiny_model_f64(), "grpo token-mean, LoRA"
    over = {**CASES[name], **FSDP, "rollout.seed_mode": "row", "rollout.sync_bucket_mb": 0.01,
            "eval.task": "arithmetic", "trainer.eval_steps": 3, "eval.max_new_tokens": 3}
    pool = {"trainer.backend": "ray", "trainer.n_workers_per_node": 2, "placement.rollout.enable_resource_pool": "true",
            "placement.rollout.n_workers_per_node": 2}
    evals = [{"prompt": p["prompt"], "answer": "a"} for p in PROMPTS[:3]]
    runs = {b: train_grpo(model, grpo_config(tmp_path / b, **over, **(pool if b == "ray" else {})), eval_dataset=evals)
            for b in ("local", "ray")}
    for k, v in runs["local"]["actor"].items():
        assert float((v - runs["ray"]["actor"][k]).abs().max()) <= 1e-10, k
    for a, b in zip(lines(tmp_path / "local"), lines(tmp_path / "ray"), strict=True):
        for key in ("reward/mean", "response_length/mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), (a["step"], key)
    last = [{k: v for k, v in lines(tmp_path / b)[-1].items() if k.startswith("eval/")} for b in ("local", "ray")]
    assert len(last[0]) >= 2 and last[0] == pytest.approx(last[1], abs=1e-9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_offload_without_cuda_and_none_over_workers_are_refused_naming_the_key(tmp_path):
    for key in ("param_offload", "optimizer_offload"):
        with pytest.raises(ConfigError, match=rf"trainer.fsdp.{key}: moves GPU memory to the CPU.*no GPU"):
            grpo_config(tmp_path, **FSDP, **{f"trainer.fsdp.{key}": "true"})
        with pytest.raises(ConfigError, match=rf"trainer.fsdp.{key}: offloads FSDP2 shards: set trainer.strategy=fsdp2"):
            grpo_config(tmp_path, **{f"trainer.fsdp.{key}": "true"})
    ray = {"trainer.backend": "ray", "trainer.n_workers_per_node": 2}
    with pytest.raises(ConfigError, match=r"trainer.strategy: none .* 2 workers: set trainer.strategy=ddp"):
        grpo_config(tmp_path, **ray, **{"trainer.strategy": "none"})
    assert grpo_config(tmp_path, **ray, **FSDP).trainer.strategy == "fsdp2"


def cut_after(run: Path, step: int, to: Path) -> Path:
    """A copy of `run` whose last checkpoint is step `step` (a resume starts there)."""
    shutil.copytree(run, to)
    for later in (to / "checkpoints").glob("step-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    shutil.rmtree(to / "final")
    return to


@pytest.mark.slow  # ~4 Ray runs on 2 cores
def test_four_sharded_workers_and_a_resume_four_two_one_give_the_local_update(ray_session, tmp_path):
    """4 sharded workers give the local run; their step-1 checkpoint resumes on 2 workers, whose
    step-2 checkpoint resumes on the local backend (DCP reshards the shards, AdamW's included),
    ending on the local run's parameters."""
    name = "grpo seq-mean, reference synced"
    model, over = tiny_model_f64(), {**CASES[name], **FSDP, "trainer.save_steps": 1}
    ray = {"trainer.backend": "ray"}
    local = train_grpo(model, grpo_config(tmp_path / "local", **over))
    four = train_grpo(model, grpo_config(tmp_path / "w4", **over, **ray, **{"trainer.n_workers_per_node": 4}))
    two = cut_after(tmp_path / "w4", 1, tmp_path / "w4-2")
    train_grpo(model, grpo_config(two, **over, **ray, **{"trainer.n_workers_per_node": 2}))
    one = cut_after(two, 2, tmp_path / "w4-2-1")
    resumed = train_grpo(model, grpo_config(one, **over))
    assert [m["step"] for m in lines(one)] == [1, 2, 3]
    for got in (four, resumed):
        for k, v in local["actor"].items():
            assert float((v - got["actor"][k]).abs().max()) <= 1e-10, k
