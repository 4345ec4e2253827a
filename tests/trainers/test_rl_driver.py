"""The RL driver holds no weights: each pool's worker 0 writes the HF folders of checkpoints and
final/ (`RLWorker.save_hf`), byte for byte the files the driver wrote from worker 0's modules
before, sharded (fsdp2) parameters gathered one at a time (`fsdp.full_copy`). The Ray
side (no parameter in the driver during and after a run; eval on the workers equal to the
local run's) is in test_rl_ray.py."""

from pathlib import Path

import pytest
import torch

from posttrain.checkpoint import RunModels
from posttrain.models.lora import is_peft, merged_for_export

from .test_rl import config, in_process_worker, tiny_model, trainer_for


def files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("lora", [False, True])
def test_worker_zero_writes_the_folders_the_driver_wrote(tmp_path, lora):
    """PPO with a synced reference (LoRA: its adapter, the reference being the base): the
    checkpoint's and final/'s files equal those `RunModels` writes from the modules, byte for byte."""
    extra = {"model.lora.r": 4, "model.lora.alpha": 8} if lora else {"algorithm.kl.in_loss": "true"}
    trainer = trainer_for(config(tmp_path / "run", "gae", **{"trainer.max_steps": 1, **extra}))
    w = in_process_worker(trainer)
    if not lora:
        trainer.roles.ref.sync(0.5)
    with torch.no_grad():  # weights that differ from the initial ones
        for p in w.actor.model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    policy, critic = w.actor.model, w.critic.model
    trainer.roles.save_hf(tmp_path / "ckpt", final=False)
    ref = w.ref.saved_model() if w.ref is not None else None
    RunModels(policy, critic, reference=ref, with_optimizer=False).save_pretrained(tmp_path / "ckpt_before")
    trainer.roles.save_hf(tmp_path / "final", final=True)
    RunModels(merged_for_export(policy), critic, adapter=policy if is_peft(policy) else None,
              with_optimizer=False).save_pretrained(tmp_path / "final_before")
    for new, old in (("ckpt", "ckpt_before"), ("final", "final_before")):
        written, before = files(tmp_path / new), files(tmp_path / old)
        assert written == before and "critic/model.safetensors" in written
        assert ("adapter/adapter_model.safetensors" in written) == (lora and new == "final")
        assert ("reference/model.safetensors" in written) == (not lora and new == "ckpt")


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (destroyed after)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sharded_parameters_are_gathered_into_the_same_files(tmp_path, one_rank_group):
    """fsdp2 (`fully_shard` per layer, then the root): `RLWorker._whole` gathers the policy into
    a plain CPU copy (`fsdp.full_copy`, one parameter at a time) whose files equal the
    unsharded model's, byte for byte; unsharded, worker 0 writes its own module (no copy)."""
    from posttrain.distributed.fsdp import shard_model, skeleton
    from posttrain.trainers.rl_worker import RLWorker

    model = tiny_model()
    model.save_pretrained(tmp_path / "plain")
    sharded = tiny_model()
    worker = RLWorker.__new__(RLWorker)  # only the gather's state: rank, sharding, templates
    worker.rank, worker.sharded, worker.templates = 0, False, {}
    assert worker._whole("actor", sharded) is sharded
    worker.sharded, worker.templates["actor"] = True, skeleton(sharded)
    shard_model(sharded)
    assert any(hasattr(p, "full_tensor") for p in sharded.parameters())
    full = worker._whole("actor", sharded)
    assert all(not hasattr(p, "full_tensor") and p.device.type == "cpu" for p in full.parameters())
    full.save_pretrained(tmp_path / "gathered")
    assert files(tmp_path / "gathered") == files(tmp_path / "plain")
