"""trainer.backend=ray on CPU: 2 workers give the local backend's update exactly (GRPO; PPO's
actor and critic; a reference synced every 2 steps; GuessNumber episodes played on worker 0;
generation split over the workers with rollout.seed_mode=row, single-turn and episodes),
the critic and the rollout on resource pools of their own give the local update too, the CLI
runs end to end with the local run's directory and metrics, an impossible placement (of one
pool or of several together) fails in seconds, and no Ray process outlives a run. Resumes
and dying workers: test_rl_ray_faults.py.

The driver's views over pools of their own are first checked without Ray, over a `LocalWorkerGroup`
per pool. Ray runs on 127.0.0.1 in a short temp dir; the tests that share a session get it from one
module fixture (conftest.py), whose finalizer shuts it down and checks that its raylet is gone.
"""

import copy
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from posttrain.cli import main
from posttrain.config import ConfigError, build_config
from posttrain.data.tasks import make_task
from posttrain.distributed.groups import GroupSpec, LocalWorkerGroup, RayWorkerGroup
from posttrain.distributed.pools import WorkerPools
from posttrain.distributed.register import role_view
from posttrain.models import BuiltinLM
from posttrain.trainers.rl_build import build_rollout
from posttrain.trainers.rl_ray import start_worker_pools
from posttrain.trainers.rl_roles import views
from posttrain.trainers.rl_worker import RLWorker, pool_factories
from posttrain.workers import RLBatch

from .conftest import GUESS_ROWS
from .ray_procs import raylets, wait_gone
from .words import WORDS, word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"prompt": " ".join(WORDS[(i * 7 + k) % 8] for k in range(1 + i % 4))} for i in range(32)]
COMPARED = ("grad_norm", "policy_loss", "entropy", "clip_frac", "approx_kl", "kl", "lr", "reward/mean",
            "response_length/mean")


def tiny_model_f64():
    torch.manual_seed(0)
    return BuiltinLM.from_preset("tiny", vocab_size=len(WORDS) + 3, num_hidden_layers=1, hidden_size=32,
                                 intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0).double()


def starts_with_a(prompts, completions, completion_ids, **columns):
    return [1.0 if ids and ids[0] == 3 else 0.0 for ids in completion_ids]


starts_with_a.is_correctness = True  # reward 1 is right: it defines `accuracy`


def grpo_config(run_dir, cls=GRPOConfig, **overrides):
    base = {"rollout.n": 4, "rollout.max_new_tokens": 4, "data.train_batch_size": 4, "actor.micro_batch_size": 4,
            "trainer.max_steps": 3, "trainer.learning_rate": 3e-2, "trainer.lr_scheduler": "constant",
            "trainer.precision": "fp32", "trainer.report_to": [], "trainer.progress": False,
            "trainer.output_dir": str(run_dir)}
    base.update(overrides)
    return build_config(cls, None, [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in base.items()])


def lines(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


TOKEN_MEANS = ("entropy", "clip_frac", "approx_kl", "kl")
"""Token means merged with the loss's weights: under a seq-mean aggregation a micro-batch
weighs its sequences, so these depend on how rows are grouped (locally, on
actor.micro_batch_size too); the loss, the gradient and the parameters do not."""

SETTINGS = {
    "on-policy token-mean": {},
    "split generation (row sampler)": {"rollout.seed_mode": "row"},  # ray: rollout.dispatch=auto → split
    "mini-batches, seq-mean, KL in the loss": {
        "actor.ppo_mini_batch_size": 2, "actor.micro_batch_size": 2,
        "actor.policy_loss.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.kl.in_loss": "true", "algorithm.kl.coef": 0.1,
    },
    "reference synced every 2 steps": {  # TR-DPO: step 3's KL is to ref ← 0.6·π + 0.4·ref
        "actor.ppo_mini_batch_size": 2, "algorithm.kl.in_loss": "true", "algorithm.kl.coef": 0.5,
        "algorithm.ref_sync_steps": 2, "trainer.save_steps": 2,
    },
    "ppo": {  # critic warmup (step 1 trains the critic alone), 2 epochs of 2 mini-batches, KL in the reward
        "cls": PPOConfig, "rollout.n": 2, "actor.ppo_mini_batch_size": 2, "actor.ppo_epochs": 2,
        "actor.micro_batch_size": 2, "critic.micro_batch_size": 4, "critic.learning_rate": 1e-2,
        "critic.warmup_steps": 1, "algorithm.kl.in_reward": "true", "algorithm.kl.coef": 0.05,
        # token TIS with C = 0.5 < the ratio 1: every weight 0.5, which must reach each worker's loss
        "algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_threshold": 0.5,
    },
}
PPO_COMPARED = ("value_loss", "values/mean", "returns/mean", "critic/grad_norm")
"""Compared to float32's precision: the critic computes its values in float32 (`Critic.loss`),
so merging its metrics over another grouping of rows rounds differently (~1e-9 here)."""


POOLS = {"placement.critic.enable_resource_pool": "true", "placement.rollout.enable_resource_pool": "true"}
"""The critic and the rollout on pools of their own (1 worker each)."""


def on(backend, **ray_only):
    """The overrides of a run on `backend`: on Ray, 2 workers and `ray_only` (refused locally)."""
    return {"trainer.backend": backend, **({"trainer.n_workers_per_node": 2, **ray_only} if backend == "ray" else {})}


def config(run_dir, name, **overrides):
    return grpo_config(run_dir, **{**SETTINGS[name], **overrides})


def train(model, cfg, local_group=False, rows=PROMPTS, tokenizer=None, pools=None, **kwargs):
    """Train a copy of `model`; local_group: on views over a `LocalWorkerGroup` per pool of
    `pools` (no Ray; a trainer.backend=ray config, default `cfg`'s). Returns {role: state dict}
    of the actor (and critic)."""
    trainer_cls = PPOTrainer if isinstance(cfg, PPOConfig) else GRPOTrainer
    trainer = trainer_cls(copy.deepcopy(model), args=cfg, train_dataset=rows,
                          processing_class=tokenizer or word_tokenizer(), **kwargs)
    if local_group:
        r, placed = trainer.roles, pools or cfg
        value = r.critic.model() if r.critic is not None else None
        _, mapping = placed.resource_pools()
        args = pool_factories(placed, trainer.tokenizer, trainer.model, value, r.rollout.env_factory, mapping)
        groups = WorkerPools({name: LocalWorkerGroup(RLWorker, *copy.deepcopy(a)) for name, a in args.items()})
        trainer.roles = views(placed, groups, mapping, r.reward, r.rollout.env_factory)
    trainer.train()
    roles = {"actor": trainer.model, "critic": trainer.value_model}
    return {k: {n: v.detach().clone() for n, v in m.state_dict().items()} for k, m in roles.items() if m is not None}


def train_grpo(model, cfg, local_group=False, pools=None, **kwargs):
    return train(model, cfg, local_group, pools=pools, reward_funcs=[starts_with_a], **kwargs)


def saved_models(run_dir):
    """{checkpoint/role: state dict} of the critic and synced reference every checkpoint holds."""
    from safetensors.torch import load_file

    return {f"{f.parent.parent.name}/{f.parent.name}": load_file(f)
            for f in sorted(Path(run_dir, "checkpoints").glob("step-*/*/model.safetensors"))}


def assert_same_run(a_dir, b_dir, a, b, name, tol):
    """Same parameters (every role), saved critics / references, and metrics."""
    assert a.keys() == b.keys()
    for role in a:
        for k in a[role]:
            assert float((a[role][k] - b[role][k]).abs().max()) <= tol, (role, k)
    sa, sb = saved_models(a_dir), saved_models(b_dir)
    assert sa.keys() == sb.keys()
    for part in sa:
        for k in sa[part]:
            assert float((sa[part][k] - sb[part][k]).abs().max()) <= tol, (part, k)
    seq_mean = SETTINGS[name].get("actor.policy_loss.loss_agg_mode", "token-mean") != "token-mean"
    keys = [k for k in COMPARED if not (seq_mean and k in TOKEN_MEANS)]
    ppo = SETTINGS[name].get("cls") is PPOConfig
    for x, y in zip(lines(a_dir), lines(b_dir), strict=True):
        for key in keys:
            assert x[key] == pytest.approx(y[key], abs=tol * 10), (x["step"], key)
        for key in PPO_COMPARED if ppo else ():
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=tol * 10), (x["step"], key)


def test_views_over_pools_of_their_own_give_the_local_run_without_ray(tmp_path, monkeypatch):
    """PPO with the critic and the rollout on pools of their own, each an in-process worker:
    the rollout worker's policy copy takes the actor's weights after each update, streamed in
    buckets of rollout.sync_bucket_mb over a weight group (`rl_roles.PoolSync`; no state dict
    handed over: that path is gone), the critic's worker trains alone, and the run is the local one."""
    from posttrain.distributed.register import Dispatch, declarations
    from posttrain.rollout.weight_stream import WeightGroup

    sent, broadcast = [], WeightGroup.broadcast

    def counted(group, buf, src):
        if group.rank == src:
            sent.append(buf.numel())  # bytes: a bucket is a uint8 buffer
        broadcast(group, buf, src)

    monkeypatch.setattr(WeightGroup, "broadcast", counted)
    joined, closed, join, close = [], [], WeightGroup.join.__func__, WeightGroup.close

    def joining(cls, *args, **kwargs):
        joined.append(join(cls, *args, **kwargs))
        return joined[-1]

    def closing(group):
        closed.append(group)
        close(group)

    monkeypatch.setattr(WeightGroup, "join", classmethod(joining))
    monkeypatch.setattr(WeightGroup, "close", closing)
    model, name = tiny_model_f64(), "ppo"
    local = train_grpo(model, config(tmp_path / "local", name))
    pools = config(tmp_path / "unused", name, **on("ray", **POOLS, **{"rollout.sync_bucket_mb": 0.01}))
    grouped = train_grpo(model, config(tmp_path / "group", name), local_group=True, pools=pools)
    assert_same_run(tmp_path / "local", tmp_path / "group", local, grouped, name, 1e-12)
    bucket, largest = int(0.01 * 2**20), max(p.numel() * 8 for p in model.parameters())
    per_sync = len(sent) // 3  # after each of the 3 steps
    assert len(sent) == 3 * per_sync and per_sync >= 3, sent
    assert max(sent) <= max(bucket, largest) and sum(sent[:per_sync]) >= 8 * sum(p.numel() for p in model.parameters())
    assert len(joined) == 2 and {id(g) for g in closed} == {id(g) for g in joined}  # torn down at the end
    names = {d.name or attr for attr, d in declarations(RLWorker).items()}
    assert not {"policy_weights", "load_weights"} & names and not hasattr(Dispatch, "RANK_ZERO_REF")



@pytest.mark.parametrize("world", [2, 3])
def test_a_split_rollout_over_any_group_samples_the_local_rollout_s_rows(tmp_path, world, in_process_group):
    """Every worker generates its slice and the joined batch, the driver's uids included, is
    the local rollout's with the row sampler: twice."""
    cfg = grpo_config(tmp_path, **{"rollout.seed_mode": "row", "trainer.backend": "ray",
                                   "trainer.n_workers_per_node": world, "rollout.calculate_log_probs": "true"})
    model, tok = tiny_model_f64(), word_tokenizer()
    group = in_process_group(RLWorker, world, cfg, tok, model)
    split = role_view(group, RLWorker, "rollout", {"split": cfg.rollout.split})
    local = build_rollout(cfg, copy.deepcopy(model), tok)
    rows: list[int] = []
    for w in group.workers:  # each worker's prompts
        w.rollout.generate = counted(w.rollout.generate, rows)
    for seed in (3, 4):
        prompts = RLBatch.from_prompts([{"ids": tok(p["prompt"])["input_ids"], "prompt": p["prompt"], "columns": {}}
                                        for p in PROMPTS[:5]], 0).replace(uid=torch.arange(5) + seed * 5)
        a, b = split.generate(prompts, seed), local.generate(prompts, seed)
        assert a.completions == b.completions and torch.equal(a.uid, b.uid) and torch.equal(a.lengths, b.lengths)
        torch.testing.assert_close(a.rollout_logp, b.rollout_logp, rtol=0, atol=1e-12)
    assert rows == [5 // world + (r < 5 % world) for r in range(world)] * 2  # every worker its slice, twice


def counted(generate, rows):
    def wrapped(prompts, *args):
        rows.append(len(prompts))
        return generate(prompts, *args)

    return wrapped


@pytest.mark.parametrize("name", list(SETTINGS))
def test_two_workers_give_the_local_update(ray_session, tmp_path, name):
    """PPO: the actor's and the critic's parameters; a synced reference: the reference each
    checkpoint holds, and the actor's parameters, which its KL term moved."""
    model = tiny_model_f64()
    runs = {backend: train_grpo(model, config(tmp_path / backend, name, **on(backend)))
            for backend in ("local", "ray")}
    start = model.state_dict()  # the critic's too (with a zero head)
    for role, state in runs["local"].items():
        moved = max(float((v - start[k]).abs().max()) if k in start else float(v.abs().max()) for k, v in state.items())
        assert moved > 1e-4, role  # the run trained
    if "algorithm.ref_sync_steps" in SETTINGS[name]:
        assert "step-2/reference" in saved_models(tmp_path / "ray")
    assert_same_run(tmp_path / "local", tmp_path / "ray", runs["local"], runs["ray"], name, 1e-10)


def test_a_shared_critic_backbone_is_refused_on_ray_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"critic.share_backbone: .*share_backbone=false.*trainer.backend=local"):
        config(tmp_path, "ppo", **{"trainer.backend": "ray", "critic.share_backbone": "true",
                                   "critic.warmup_steps": 0})
    # the vllm engine runs on GPU workers (CUDA build) or CPU workers (CPU build: tests/trainers/test_rl_vllm.py)
    assert config(tmp_path, "ppo", **{"trainer.backend": "ray", "rollout.engine": "vllm"}).placement.gpus_per_worker == 0
    gpu = config(tmp_path, "ppo", **{"trainer.backend": "ray", "rollout.engine": "vllm", "placement.gpus_per_worker": 1})
    assert gpu.placement.gpus_per_worker == 1 and gpu.rollout.engine == "vllm"


FILE_GAME = """
import dataclasses

from posttrain.envs import GuessNumber


class EveryTurnCounts(GuessNumber):
    \"\"\"GuessNumber whose right guess earns 1 at any turn (a class the workers cannot import).\"\"\"

    def step(self, action):
        result = super().step(action)
        return dataclasses.replace(result, reward=1.0) if result.reward else result
"""




def episode_config(run_dir, env, **overrides):
    return grpo_config(run_dir, **{
        "rollout.env": env, "rollout.max_new_tokens": 24, "rollout.multi_turn.max_turns": 3,
        "rollout.multi_turn.max_total_tokens": 96, "data.train_batch_size": 2, "actor.ppo_mini_batch_size": 1,
        "trainer.learning_rate": 1e-3, **overrides})


@pytest.mark.parametrize("env", ["guess_number", "file"])
def test_two_workers_give_the_local_update_over_episodes(ray_session, guesser, tmp_path, env):
    """guess_number: worker 0 plays every episode (the local run's trajectories, exactly);
    file: rollout.seed_mode=row, each worker plays its slice of the prompts (the local run's
    trajectories with the row sampler), and an environment from a file reaches the workers by
    value. Then the batch is split for log-probs and the update."""
    model, tok = guesser
    seed_mode = "batch"
    if env == "file":
        (tmp_path / "my_game.py").write_text(FILE_GAME)
        env, seed_mode = f"{tmp_path / 'my_game.py'}:EveryTurnCounts", "row"
    runs = {backend: train(model, episode_config(tmp_path / backend, env, **on(backend), **{
        "rollout.seed_mode": seed_mode}),
        rows=GUESS_ROWS, tokenizer=tok) for backend in ("local", "ray")}
    start = model.state_dict()
    assert max(float((v - start[k]).abs().max()) for k, v in runs["local"]["actor"].items()) > 1e-4
    for k, v in runs["local"]["actor"].items():
        assert float((v - runs["ray"]["actor"][k]).abs().max()) <= 1e-10, k
    local, ray = lines(tmp_path / "local"), lines(tmp_path / "ray")
    assert max(m["turns/max"] for m in local) > 1 and max(m["reward/std"] for m in local) > 0  # multi-turn, learning
    # Not the ratio metrics (approx_kl, clip_frac): off-policy they are means over the rows that
    # ran, and a worker whose share holds only zero-advantage rows runs them (`Actor.update_parts`).
    for a, b in zip(local, ray, strict=True):
        for key in ("turns/mean", "turns/max", "tool_calls/mean", "env/reward/mean", "reward/mean", "response_length/mean",
                    "grad_norm", "policy_loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), (a["step"], key)


@pytest.mark.slow  # a worker's start
def test_an_environment_raising_on_a_worker_is_counted_as_the_local_backend_counts_it(ray_session, tmp_path):
    """A `reset` that raises on a Ray worker ends its episodes and is counted in env/errors, as
    on the local backend; both runs finish."""
    path = tmp_path / "no_secret.py"
    path.write_text("from posttrain.envs import GuessNumber\n\n\nclass NoSecret(GuessNumber):\n"
                    "    columns = ()\n\n    def reset(self, row):\n        return row['secret']\n")
    for backend in ("local", "ray"):
        train(tiny_model_f64(), episode_config(tmp_path / backend, f"{path}:NoSecret", **{"trainer.backend": backend}))
    local, ray = lines(tmp_path / "local"), lines(tmp_path / "ray")
    assert [m["env/errors"] for m in ray] == [m["env/errors"] for m in local] and local[0]["env/errors"] > 0


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def listening(pids) -> dict[str, list[str]]:
    """{"pid name": the addresses it listens on (TCP, IPv4 and IPv6)} of each live process in `pids`."""
    import psutil

    found = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found[f"{pid} {proc.name()}"] = sorted({c.laddr.ip for c in proc.net_connections(kind="inet")
                                                    if c.status == psutil.CONN_LISTEN})
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_ray_started_after_import_ray_listens_on_loopback_only(ray_session):
    """Issue #31 item 10: the module's Ray was started after `import ray` (the fixture imports it
    first, as a program that uses Ray itself does). Before, Ray read its loopback switch only at
    import, so this Ray's GCS, raylet, agents and workers listened on every interface (`*:port`)
    and on the machine's address; now every socket of every process it started is on loopback."""
    psutil = pytest.importorskip("psutil")
    ray = ray_session.ray

    @ray.remote
    def worker_pid():
        return os.getpid()

    worker = ray.get(worker_pid.remote())
    found = listening([os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))])
    names = " ".join(found)
    assert "gcs_server" in names and "raylet" in names and any(k.startswith(f"{worker} ") for k in found), found
    assert all(set(ips) <= LOOPBACK for ips in found.values()), found


LISTENERS = """
import json, os, psutil
import ray  # first, as a program that uses Ray itself does
from posttrain.distributed.groups import GroupSpec, RayWorkerGroup
from posttrain.distributed.ray_session import RaySession

session = RaySession(None, num_cpus=2)
group = RayWorkerGroup(GroupSpec(1, 2, 1, None), lambda rank, world, collective: rank)
try:
    assert group.one_to_all("bit_length") == [0, 1]  # the group works: its store and gloo are up
    procs = {os.getpid(), *group.pids, *(p.pid for p in psutil.Process().children(recursive=True))}
    found = {str(pid): sorted({c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
                               if c.status == psutil.CONN_LISTEN}) for pid in procs if psutil.pid_exists(pid)}
    print(json.dumps({"workers": [str(p) for p in group.pids], "found": found}))
finally:
    group.close()
    session.close()
"""


@pytest.mark.slow  # ~15 s: a Ray of its own, started after `import ray`, and two workers
def test_a_ray_run_listens_on_loopback_only():
    # Before: rank 0's rendezvous store (init_process_group("tcp://...")) listened on *:<port>,
    # and a Ray started after `import ray` listened on every interface.
    result = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    found = out["found"]
    assert set(out["workers"]) <= set(found) and len(found) > 5, found  # the workers, the GCS, the raylet, ...
    assert all(set(ips) <= LOOPBACK for ips in found.values()), found
    assert all(found[w] for w in out["workers"])  # the workers' listeners (the store, gloo, Ray's) were seen


def test_an_impossible_placement_fails_in_seconds_naming_the_key(ray_session):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"trainer.n_workers_per_node, placement.cpus_per_worker: .* 64 CPUs, "
                                          r"but the Ray cluster at \S+:\d+ has 4 CPUs on 1 node\(s\) \(\d free\)"):
        RayWorkerGroup(GroupSpec(1, 64, 1, None), dict)
    assert time.perf_counter() - start < 10
    assert ray_session.ray.is_initialized()  # a joined session is left running



def test_impossible_pools_fail_in_seconds_over_the_sum_of_their_bundles(ray_session, tmp_path):
    """3 pools of 2 + 1 + 1 workers fit 4 CPUs one by one, not together: the error names every
    pool's keys before any worker starts. Pools that fit the cluster but not its free CPUs
    time out, and leave no placement group behind."""
    from posttrain.distributed.ray_session import Bundles, place

    cfg = config(tmp_path, "ppo", **{"trainer.backend": "ray", "trainer.n_workers_per_node": 2, **POOLS,
                                     "placement.critic.n_workers_per_node": 2})
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"trainer.n_workers_per_node, placement.cpus_per_worker, "
                       r"placement.critic.n_workers_per_node, placement.rollout.n_workers_per_node: .*"
                       r"placement.critic.n_workers_per_node=2 × placement.critic.nnodes=1 .* = 5 CPUs, "
                       r"but the Ray cluster at \S+:\d+ has 4 CPUs on 1 node\(s\) \(\d free\)"):
        specs, mapping = cfg.resource_pools()
        start_worker_pools(cfg, specs, mapping, pool_factories(cfg, word_tokenizer(), tiny_model_f64(),
                                                               tiny_model_f64(), None, mapping))
    ray = ray_session.ray
    held = place(ray, [Bundles(3, 1, "3 held", ("held",))], 5)  # 3 of the 4 CPUs taken
    try:
        with pytest.raises(ConfigError, match=r"a, b: 1 \+ 1 = 2 CPUs could not be placed within 1 s; the Ray "
                           r"cluster has 4 CPUs on 1 node\(s\), \d free"):
            place(ray, [Bundles(1, 1, "1", ("a",)), Bundles(1, 1, "1", ("b",))], 1)
    finally:
        ray.util.remove_placement_group(held[0])
    assert time.perf_counter() - start < 15
    states = [g["state"] for g in ray.util.placement_group_table().values()]
    assert "PENDING" not in states and states.count("CREATED") == 0, states


def test_critic_and_rollout_on_pools_of_their_own_give_the_local_update(ray_session, tmp_path):
    """PPO on 2 actor workers, 1 critic worker (its own gloo group) and 1 rollout worker
    (its own policy copy, loading actor rank 0's weights after each update): the local run's
    actor and critic within 1e-10 after 3 steps, so the rollout sampled the local tokens."""
    model = tiny_model_f64()
    runs = {backend: train_grpo(model, config(tmp_path / backend, "ppo", **on(backend, **POOLS)))
        for backend in ("local", "ray")}
    assert set(runs["ray"]) == {"actor", "critic"}
    assert_same_run(tmp_path / "local", tmp_path / "ray", runs["local"], runs["ray"], "ppo", 1e-10)


def cli_args(data, run, backend):
    return ["grpo", "--config", str(ROOT / "recipes" / "grpo.yaml"), "model.path=null", "model.init=tiny",
            f"data.train_files=[{data / 'train.jsonl'}]", f"data.eval_files=[{data / 'test.jsonl'}]",
            "eval.num_examples=2", "eval.max_new_tokens=6", "trainer.eval_steps=2", "trainer.save_steps=1",
            "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
            "rollout.n=2", "rollout.max_new_tokens=6", "actor.micro_batch_size=4", "trainer.max_steps=2",
            "algorithm.overlong.buffer=0", f"trainer.output_dir={run}", "trainer.report_to=[]",
            "trainer.progress=false", f"trainer.backend={backend}",
            *(["trainer.nnodes=1", "trainer.n_workers_per_node=2"] if backend == "ray" else [])]


def test_cli_grpo_on_ray_runs_end_to_end_like_local_and_leaves_no_process(tmp_path):
    """The same metrics and the same files, DCP shards included (one checkpoint layout)."""
    pytest.importorskip("ray")
    data = tmp_path / "data"
    make_task("arithmetic", data, n_train=16, n_test=4, seed=0, difficulty="easy")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", *cli_args(data, tmp_path / "ray", "ray")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    # its own raylet: the Ray it started lives in /tmp/ptray-<its pid>-* (ray_session)
    assert not wait_gone(raylets(f"/tmp/ptray-{proc.pid}-")), "the run left a raylet behind"
    torch.manual_seed(0)
    assert main(cli_args(data, tmp_path / "local", "local")) == 0
    ray_lines, local_lines = lines(tmp_path / "ray"), lines(tmp_path / "local")
    assert [m["step"] for m in ray_lines] == [m["step"] for m in local_lines] == [1, 2]
    assert [sorted(m) for m in ray_lines] == [sorted(m) for m in local_lines]
    listing = {b: {p.relative_to(tmp_path / b).as_posix() for p in (tmp_path / b).rglob("*")} for b in ("ray", "local")}
    per_rank = {b: {p for p in files if p.endswith(".distcp")} for b, files in listing.items()}  # one per worker
    assert {len(v) for v in per_rank.values()} == {4, 2}  # 2 checkpoints × 2 Ray workers; × 1 local worker
    assert {"checkpoints/step-1/dcp/actor/.metadata", "checkpoints/step-2/dcp/actor/.metadata"} <= listing["ray"]
    assert listing["ray"] - per_rank["ray"] == listing["local"] - per_rank["local"]
    assert (tmp_path / "ray" / "final" / "config.json").is_file() and "eval/accuracy" in ray_lines[-1]
    assert sorted(p.name for p in (tmp_path / "ray" / "checkpoints").iterdir()) == ["step-1", "step-2"]
    # eval.task (the recipe's) generated on actor worker 0, as in process: the local run's eval metrics
    evals = [{k: v for k, v in m.items() if k.startswith("eval/")} for m in (ray_lines[-1], local_lines[-1])]
    assert len(evals[0]) >= 3 and evals[0] == pytest.approx(evals[1], abs=1e-6)
    from safetensors.torch import load_file  # final/, written by worker 0: the local run's weights

    saved = [load_file(tmp_path / b / "final" / "model.safetensors") for b in ("ray", "local")]
    assert saved[0].keys() == saved[1].keys()
    assert all(torch.allclose(saved[0][k], saved[1][k], atol=1e-5) for k in saved[0])


@pytest.mark.slow
def test_a_critic_pool_of_two_workers_gives_the_local_update(ray_session, tmp_path):
    """2 actor workers (rollout colocated) + 2 critic workers in their own gloo group."""
    model = tiny_model_f64()
    pool = {"placement.critic.enable_resource_pool": "true", "placement.critic.n_workers_per_node": 2}
    runs = {backend: train_grpo(model, config(tmp_path / backend, "ppo", **on(backend, **pool)))
        for backend in ("local", "ray")}
    assert_same_run(tmp_path / "local", tmp_path / "ray", runs["local"], runs["ray"], "ppo", 1e-10)


@pytest.mark.slow
def test_episodes_on_a_rollout_pool_of_two_workers_give_the_local_update(ray_session, guesser, tmp_path):
    """GuessNumber episodes from a file, played on the rollout pool's worker 0 over its own
    copy of the policy (synced from actor rank 0 after each update): the local trajectories."""
    model, tok = guesser
    (tmp_path / "my_game.py").write_text(FILE_GAME)
    env = f"{tmp_path / 'my_game.py'}:EveryTurnCounts"
    pool = {"placement.rollout.enable_resource_pool": "true", "placement.rollout.n_workers_per_node": 2}
    runs = {backend: train(model, episode_config(tmp_path / backend, env, **on(backend, **pool)),
        rows=GUESS_ROWS, tokenizer=tok) for backend in ("local", "ray")}
    for k, v in runs["local"]["actor"].items():
        assert float((v - runs["ray"]["actor"][k]).abs().max()) <= 1e-10, k
    local, ray = lines(tmp_path / "local"), lines(tmp_path / "ray")
    assert max(m["turns/max"] for m in local) > 1
    for a, b in zip(local, ray, strict=True):
        for key in ("turns/mean", "env/reward/mean", "reward/mean", "response_length/mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), (a["step"], key)


def test_epochs_callbacks_and_reward_arguments_on_the_ray_roles(tmp_path):
    """trainer.backend=ray's driver-side roles (over a local worker group, no Ray): the reward
    runs in the driver, so trainer_state and log_metric reach it as on the local backend; the
    loop's epochs and callbacks (any object with TrainerCallback's methods) are the driver's too."""
    seen = []

    def shaped(completion_ids, trainer_state, log_metric, **columns):
        seen.append((trainer_state.global_step, trainer_state.epoch))
        log_metric("first_is_a", sum(bool(ids) and ids[0] == 3 for ids in completion_ids) / len(completion_ids))
        return starts_with_a(None, None, completion_ids)

    class StopAtTwo:
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    by_epochs = {"trainer.max_steps": "null", "trainer.num_train_epochs": 0.5}  # 32 prompts, 4 per step: 4 steps
    cfg = grpo_config(tmp_path, **by_epochs)
    pools = grpo_config(tmp_path, **{"trainer.backend": "ray", "trainer.max_steps": 4})
    train(tiny_model_f64(), cfg, local_group=True, pools=pools, reward_funcs=[shaped], callbacks=[StopAtTwo()])
    assert cfg.trainer.max_steps == 4 and seen == [(0, 0.0), (1, 0.125)]
    steps = lines(tmp_path)
    assert [m["step"] for m in steps] == [1, 2] and [m["epoch"] for m in steps] == [0.125, 0.25]
    assert [m["reward/shaped/first_is_a"] for m in steps] == [m["reward/shaped/mean"] for m in steps]


def driver_tensors():
    """(parameters, bytes of every tensor) this process holds, as the garbage collector sees them."""
    gc.collect()
    params = size = 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            size += o.numel() * o.element_size()
            params += o.numel() if isinstance(o, torch.nn.Parameter) else 0
    return params, size


def test_the_driver_holds_no_weights_during_and_after_a_ray_run(ray_session, tmp_path):
    """model.init=tiny on 2 Ray workers: each worker builds the policy (the driver never does);
    during the run (the callbacks' model is None) and after it, the driver holds no parameter and
    less than a tenth of the model's bytes in tensors (prompts, batches); `trainer.model` then
    reads final/, which worker 0 wrote."""
    seen = []

    class Inspect:
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append((model, *driver_tensors()))

    cfg = grpo_config(tmp_path, **{"model.init": "tiny", "trainer.max_steps": 2, "trainer.save_steps": 1,
                                   **on("ray")})
    params0, bytes0 = driver_tensors()
    trainer = GRPOTrainer(args=cfg, train_dataset=PROMPTS, processing_class=word_tokenizer(),
                          reward_funcs=[starts_with_a], callbacks=[Inspect()])
    trainer.train()
    params1, bytes1 = driver_tensors()
    model = trainer.model  # on demand: a CPU copy of final/
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes > 100_000 and len(seen) == 2
    for m, params, size in [*seen, (None, params1, bytes1)]:
        assert m is None and params <= params0 and size - bytes0 < model_bytes / 10, (params, size - bytes0)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)


@pytest.mark.slow  # ~1 min of Ray workers on 2 cores
def test_async_rollout_pool_on_ray_streams_each_update_s_staged_weights(ray_session, tmp_path):
    """trainer.async_training one_step_off with a Ray rollout pool: each update's weights are
    staged on actor worker 0 (`PoolSync.staged_sync`) and streamed from the lane's thread while
    the actor trains on; the weights are the in-turn local schedule's (float64, 1e-10)."""
    from .test_rl_async import max_diff, run, small

    over = {"trainer.async_training.max_staleness": 1, "trainer.async_training.mode": "one_step_off"}
    in_turn = run(small(tmp_path / "a", **over))
    pooled = run(small(tmp_path / "b", **over, **{"trainer.backend": "ray", "trainer.n_workers_per_node": 2,
                                                   "placement.rollout.enable_resource_pool": "true"}))
    assert pooled.pipeline.lane.pool is not None  # the rollout overlapped the update
    assert max_diff(in_turn.model, pooled.model) <= 1e-10
