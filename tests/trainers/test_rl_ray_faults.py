"""trainer.backend=ray when things stop: a run resumes exactly (a PPO run's critic too) and at
another worker count and backend (local → 2 Ray workers, 2 → local: the workers' DCP shards
reshard), and a killed worker
stops the run in seconds or restarts it exactly, with no Ray process left. The runs and
helpers are test_rl_ray.py's; the Ray session is conftest.py's, one per file.
"""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from posttrain import GRPOTrainer, PPOTrainer
from posttrain.checkpoint import RESUME_MAY_CHANGE
from posttrain.config import ConfigError
from posttrain.data.tasks import make_task
from posttrain.distributed.groups import WorkerDied
from posttrain.trainers.rl_faults import WorkerFailure

from .ray_procs import raylets, wait_gone
from .test_rl_ray import (
    POOLS,
    PROMPTS,
    ROOT,
    cli_args,
    config,
    grpo_config,
    lines,
    starts_with_a,
    tiny_model_f64,
    train_grpo,
)
from .words import word_tokenizer


@pytest.mark.parametrize("pools", [
    # slow: a resume through the same DCP path runs in the default suite at another worker count
    # (test_a_checkpoint_resumes_at_another_worker_count_and_backend)
    pytest.param({}, id="colocated", marks=pytest.mark.slow),
    pytest.param(POOLS, id="critic and rollout pools", marks=pytest.mark.slow),
])
def test_a_ray_run_resumes_exactly_from_its_checkpoint(ray_session, tmp_path, pools):
    """Every worker restores its roles from the DCP shards (`RLWorker.restore`): a PPO run's
    critic, its AdamW moments and its schedule included; a rollout pool loads the restored
    actor's weights (`Roles.sync_rollout`)."""
    model = tiny_model_f64()
    over = {"trainer.backend": "ray", "trainer.n_workers_per_node": 2, "trainer.save_steps": 1, **pools}
    full = train_grpo(model, config(tmp_path / "full", "ppo", **over))
    run = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", run)
    shutil.rmtree(run / "checkpoints" / "step-3")
    shutil.rmtree(run / "final")
    resumed = train_grpo(model, config(run, "ppo", **over))
    assert set(full) == {"actor", "critic"}
    for role in full:
        for k in full[role]:
            assert float((full[role][k] - resumed[role][k]).abs().max()) <= 1e-10, (role, k)
    assert [m["step"] for m in lines(run)] == [1, 2, 3]


def resume_at(model, name, run, workers, **over):
    """Resume a copy of `run` from its step-2 checkpoint on `workers` workers (None: the local
    backend's one); checks the checkpoint's layout first (the workers' DCP shards, no optimizer
    in trainer_state.pt: the same on every backend)."""
    step2 = run / "checkpoints" / "step-2"
    roles = {"ppo": {"actor", "critic"}}.get(name, {"actor", "ref"})
    assert {p.name for p in (step2 / "dcp").iterdir()} == roles
    assert torch.load(step2 / "trainer_state.pt", weights_only=True)["optimizer"] is None
    assert (step2 / "model.safetensors").is_file() and not (step2 / "critic" / "optimizer.pt").exists()
    cut = run.with_name(run.name + "-cut")
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoints" / "step-3", ignore_errors=True)
    shutil.rmtree(cut / "final")
    where = {"trainer.backend": "local"} if workers is None else {"trainer.n_workers_per_node": workers}
    resumed = train_grpo(model, config(cut, name, **{**over, **where}))
    assert [m["step"] for m in lines(cut)] == [1, 2, 3]
    return resumed


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for role in a:
        for k in a[role]:
            assert float((a[role][k] - b[role][k]).abs().max()) <= 1e-10, (role, k)


def test_a_checkpoint_resumes_at_another_worker_count_and_backend(ray_session, tmp_path):
    """GRPO with a synced reference; one layout on both backends: the local run's checkpoint
    (its one in-process worker's DCP shards) resumes on 2 Ray workers (1 → 2), and the 2
    workers' checkpoint on the local backend (2 → 1), each ending on the parameters of an
    uninterrupted run (the local run's and 2 workers' agree: `test_two_workers_give_the_local_update`)."""
    model, name = tiny_model_f64(), "reference synced every 2 steps"
    local = train_grpo(model, config(tmp_path / "local", name, **{"trainer.save_steps": 2}))
    over = {"trainer.backend": "ray", "trainer.save_steps": 2}
    ray = train_grpo(model, config(tmp_path / "ray", name, **over, **{"trainer.n_workers_per_node": 2}))
    assert_same_params(ray, resume_at(model, name, tmp_path / "local", 2, **over))
    assert_same_params(local, resume_at(model, name, tmp_path / "ray", None, **over))


@pytest.mark.slow
def test_a_ppo_ray_checkpoint_resumes_at_another_worker_count(ray_session, tmp_path):
    """PPO 1 → 2: the critic's shards, AdamW moments and schedule too."""
    model, name = tiny_model_f64(), "ppo"
    over = {"trainer.backend": "ray", "trainer.save_steps": 2}
    full = train_grpo(model, config(tmp_path / "w2", name, **over, **{"trainer.n_workers_per_node": 2}))
    train_grpo(model, config(tmp_path / "w1", name, **over, **{"trainer.n_workers_per_node": 1}))
    assert_same_params(full, resume_at(model, name, tmp_path / "w1", 2, **over))


# ---------------------------------------------------------------------------- a worker dies


def test_worker_failure_keys_are_refused_off_ray_naming_them(tmp_path):
    for key, value in (("trainer.on_worker_failure", "restart"), ("trainer.max_restarts", 3)):
        with pytest.raises(ConfigError, match=rf"{key}: applies to Ray workers only: set trainer.backend=ray"):
            grpo_config(tmp_path, **{key: value})
    with pytest.raises(ConfigError, match="trainer.max_restarts: must be >= 0"):
        grpo_config(tmp_path, **{"trainer.backend": "ray", "trainer.max_restarts": -1})
    assert {"trainer.on_worker_failure", "trainer.max_restarts"} <= set(RESUME_MAY_CHANGE)  # no change to the math


def test_a_killed_worker_restarts_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(ray_session, tmp_path):
    """Worker 1 is SIGKILLed at step 1 (no checkpoint yet: the run starts over) and at step 3
    (after the step-2 checkpoint: it resumes from it), each time just before the update,
    whose collective worker 0 then waits in: the group fails at once, new workers go on, and
    the run ends with the weights of an uninterrupted one (the local backend's, which 2
    workers match exactly: `test_two_workers_give_the_local_update`). No worker of the three
    sets outlives the run."""
    model = tiny_model_f64()
    over = {"trainer.save_steps": 2}
    local = train_grpo(model, config(tmp_path / "local", "on-policy token-mean", **over))
    trainer, seen = None, {"calls": 0, "pids": set()}

    def kill_at_steps_1_and_3(prompts, completions, completion_ids, **columns):
        seen["calls"] += 1
        seen["group"] = group = trainer.roles.pools["global_pool"]  # the same object across restarts
        seen["pids"] |= set(group.pids)
        if seen["calls"] in (1, 4):
            os.kill(group.pids[1], signal.SIGKILL)
        return starts_with_a(prompts, completions, completion_ids)

    cfg = config(tmp_path / "ray", "on-policy token-mean", **over, **{
        "trainer.backend": "ray", "trainer.n_workers_per_node": 2, "trainer.on_worker_failure": "restart",
        "trainer.max_restarts": 2})
    trainer = GRPOTrainer(copy.deepcopy(model), reward_funcs=[kill_at_steps_1_and_3], args=cfg,
                          train_dataset=PROMPTS, processing_class=word_tokenizer())
    trainer.train()
    assert seen["calls"] == 5  # step 1 (killed), steps 1, 2, 3 (killed), step 3
    seen["pids"] |= set(seen["group"].pids)
    assert len(seen["pids"]) == 6 and not wait_gone(seen["pids"]), "a worker outlived the run"
    for k, v in local["actor"].items():
        assert float((v - trainer.model.state_dict()[k]).abs().max()) <= 1e-10, k
    metrics = lines(tmp_path / "ray")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["worker_restarts"] for m in metrics] == [1, 1, 2]


def test_a_worker_killed_mid_save_stops_the_run_in_seconds_naming_it_and_the_last_checkpoint(ray_session, tmp_path):
    """on_worker_failure=stop (the default): worker 0 is SIGKILLed while the step-2 checkpoint
    is being written (worker 0 writes its HF folders, `RLWorker.save_hf`); the run stops within
    seconds although a collective may wait 300 s, names the worker and step-1, leaves no
    step-2 (sealed or not), and no worker process."""
    model = tiny_model_f64()
    cfg = config(tmp_path, "ppo", **{"trainer.backend": "ray", "trainer.n_workers_per_node": 2,
                                     "trainer.save_steps": 1, "trainer.collective_timeout_s": 300})
    trainer = PPOTrainer(copy.deepcopy(model), reward_funcs=[starts_with_a], args=cfg, train_dataset=PROMPTS,
                         processing_class=word_tokenizer())
    group, killed = trainer.roles.pools["global_pool"], {}
    run = group._run

    def kill_mid_save(method, args_per_rank):  # `RLWorker.save_hf`: every worker called (ONE_TO_ALL)
        if trainer.at_step == 2 and method == "save_hf" and not killed:
            killed["at"], killed["pid"] = time.perf_counter(), group.pids[0]
            os.kill(group.pids[0], signal.SIGKILL)
        return run(method, args_per_rank)

    group._run = kill_mid_save
    pids = set(group.pids)
    with pytest.raises(WorkerFailure) as err:
        trainer.train()
    assert time.perf_counter() - killed["at"] < 30
    step1 = tmp_path / "checkpoints" / "step-1"
    message = str(err.value)
    for part in (f"rank 0 (pid {killed['pid']}) of 2 (holding actor, rollout, reference, critic) died",
                 "at step 2", f"The last complete checkpoint is {step1}", "trainer.on_worker_failure=restart"):
        assert part in message, (part, message)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    assert (step1 / "COMPLETE").is_file()
    assert not wait_gone(pids), "a worker outlived the failed run"
    # a later call (async RL's rollout lane, another thread, calls on) fails with the same death,
    # not with an IndexError of the emptied worker list
    with pytest.raises(WorkerDied, match=rf"rank 0 \(pid {killed['pid']}\) of 2 .* died during `save_hf`"):
        group.rank_zero("describe")


KILL_AT_STEP_2 = """
import gc, json, os, signal
from pathlib import Path

calls = [0]


def kill_at_step_2(prompts, completions, completion_ids, **columns):
    calls[0] += 1
    if calls[0] == 2:  # the driver's worker group, found without a hook in posttrain
        group = next(o for o in gc.get_objects() if type(o).__name__ == "RayWorkerGroup")
        Path(__file__).with_name("pids.json").write_text(json.dumps(group.pids))
        os.kill(group.pids[1], signal.SIGKILL)
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_cli_run_whose_worker_dies_stops_naming_it_and_leaves_no_ray_process(tmp_path):
    """The CLI run starts its own Ray: after a worker is SIGKILLed at step 2 it exits 1 with the
    error, and neither its raylet nor any worker process (killed or surviving) is left."""
    pytest.importorskip("ray")
    data = tmp_path / "data"
    make_task("arithmetic", data, n_train=16, n_test=4, seed=0, difficulty="easy")
    (tmp_path / "killer.py").write_text(KILL_AT_STEP_2)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = [*cli_args(data, tmp_path / "ray", "ray"), f"reward.functions=[{tmp_path / 'killer.py'}:kill_at_step_2]",
            "reward.weights=null", "trainer.eval_steps=0", "trainer.collective_timeout_s=300"]
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert f"posttrain grpo: stopped: trainer.backend=ray: at step 2, Ray worker rank 1 (pid {pids[1]}) of 2" in stderr
    assert f"The last complete checkpoint is {tmp_path / 'ray' / 'checkpoints' / 'step-1'}" in stderr
    assert not wait_gone(raylets(f"/tmp/ptray-{proc.pid}-")), "the failed run left a raylet behind"
    assert not wait_gone(set(pids)), "a worker outlived the failed run"
