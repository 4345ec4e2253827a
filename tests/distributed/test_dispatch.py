"""Splitting a batch over workers and gathering it back (no processes), and the checks the
Ray backend's config makes before anything starts."""

import subprocess
import sys

import pytest
import torch

from posttrain.config import ConfigError, build_config
from posttrain.config.rl import GRPOConfig, PPOConfig
from posttrain.distributed.dispatch import (
    balanced_partition,
    gather_rows,
    shard_rows,
    split_contiguous,
)
from posttrain.distributed.groups import LocalWorkerGroup, collective_backend
from posttrain.distributed.ray_session import bundle
from posttrain.distributed.register import Dispatch, register, role_view
from posttrain.workers import RLBatch


def rl_batch(rows: int) -> RLBatch:
    """Rows of different lengths: prompt i has 1 + i % 3 tokens, response i has 1 + (3i) % 5."""
    tp, tr = 3, 5
    prompt_len = torch.tensor([1 + i % 3 for i in range(rows)])
    lengths = torch.tensor([1 + (3 * i) % tr for i in range(rows)])
    prompt_mask = (torch.arange(tp)[None, :] >= tp - prompt_len[:, None]).long()
    response_mask = (torch.arange(tr)[None, :] < lengths[:, None]).long()
    ids = torch.arange(rows * (tp + tr)).view(rows, tp + tr)
    return RLBatch(prompt_ids=ids[:, :tp] * prompt_mask, prompt_mask=prompt_mask,
                   response_ids=ids[:, tp:] * response_mask, response_mask=response_mask, lengths=lengths,
                   prompts=[f"p{i}" for i in range(rows)])


def row_sums(batch: RLBatch) -> torch.Tensor:
    """(B, Tr): a per-row computation, like a log-prob pass."""
    return batch.response_ids * 2 + batch.prompt_ids.sum(1, keepdim=True)


def test_balanced_partition_by_hand():
    # longest first to the lightest part with room: 5→A, 4→B, 2→B(6), 1→A(6), 1→A(7), 1→B(7)
    assert balanced_partition([5, 1, 1, 1, 4, 2], 2) == [[0, 1, 2], [3, 4, 5]]
    # without equal sizes the big row may stay alone
    assert balanced_partition([9, 1, 1, 1], 2, equal_size=False) == [[0], [1, 2, 3]]


@pytest.mark.parametrize("rows,world", [(7, 2), (8, 3), (5, 5), (3, 4)])
def test_shard_and_gather_give_the_whole_batch_result(rows, world):
    batch = rl_batch(rows)
    sharded = shard_rows(batch, world)
    assert len({len(p) for p in sharded.parts}) == 1 and sum(map(len, sharded.parts)) % world == 0
    assert sorted(sharded.order.tolist()) == list(range(len(sharded.order)))
    out = gather_rows([row_sums(p) for p in sharded.parts], sharded)
    torch.testing.assert_close(out, row_sums(batch), rtol=0, atol=0)
    back = gather_rows(sharded.parts, sharded)  # containers gather too
    assert back.prompts == batch.prompts and torch.equal(back.response_ids, batch.response_ids)


def test_shares_are_balanced_by_tokens():
    batch = rl_batch(12)
    totals = [int(p.token_counts().sum()) for p in shard_rows(batch, 2).parts]
    naive = [int(p.token_counts().sum()) for p in batch.chunk(2)]
    assert abs(totals[0] - totals[1]) <= max(1, abs(naive[0] - naive[1]))
    assert abs(totals[0] - totals[1]) <= int(batch.token_counts().max())


def test_an_update_share_is_not_padded_and_every_worker_gets_a_row():
    sharded = shard_rows(rl_batch(5), 2, pad=False)
    assert sorted(map(len, sharded.parts)) == [2, 3] and sharded.rows == 5


def test_split_contiguous_keeps_each_slice_s_first_row():
    batch = rl_batch(5)
    parts = split_contiguous(batch, 2)
    assert [(p.prompts, first) for p, first in parts] == [(["p0", "p1", "p2"], 0), (["p3", "p4"], 3)]
    assert [len(p) for p, _ in split_contiguous(batch, 3)] == [2, 2, 1]
    few = split_contiguous(rl_batch(1), 3)
    assert few[0][0].prompts == ["p0"] and [(p, first) for p, first in few[1:]] == [(None, 1), (None, 1)]


@pytest.mark.parametrize("rows,world", [(7, 2), (2, 3)])
def test_dp_split_runs_each_slice_with_its_first_row_and_keeps_the_order(rows, world, in_process_group):
    group = in_process_group(Doubler, world, 3)
    out = group.dp_split("tag", rl_batch(rows))
    assert len(out) == min(rows, world)  # a worker without rows returns nothing
    assert [x for part in out for x in part] == [(f"p{i}", i) for i in range(rows)]


class Doubler:
    def __init__(self, rank, world_size, collective, factor):
        self.factor, self.rank, self.collective = factor, rank, collective

    def compute(self, batch):
        return row_sums(batch) * self.factor

    def whoami(self):
        return self.rank

    def tag(self, part, first):
        """Each row of `part` with its index in the whole batch (None: no rows)."""
        return None if part is None else [(p, first + i) for i, p in enumerate(part.prompts)]


def test_local_group_has_the_ray_group_interface():
    group = LocalWorkerGroup(Doubler, 3)
    batch = rl_batch(5)
    torch.testing.assert_close(group.dp_compute("compute", batch), row_sums(batch) * 3)
    assert group.one_to_all("whoami") == [0] and group.rank_zero("whoami") == 0
    assert group.worker.collective is None
    group.close()


def grpo(*overrides):
    return build_config(GRPOConfig, None, ["data.train_batch_size=2", "rollout.n=2", "actor.micro_batch_size=2",
                                           *overrides])


def test_ray_backend_config_checks():
    assert grpo().trainer.backend == "local" and grpo().trainer.world_size == 1
    cfg = grpo("trainer.backend=ray", "trainer.nnodes=2", "trainer.n_workers_per_node=2")
    assert cfg.trainer.world_size == 4 and cfg.ray.address is None and cfg.placement.cpus_per_worker == 1
    with pytest.raises(ConfigError, match="trainer.n_workers_per_node"):
        grpo("trainer.backend=ray", "trainer.n_workers_per_node=8")  # 4 rows per mini-batch, 8 workers
    assert build_config(PPOConfig, None, ["trainer.backend=ray"]).use_critic  # PPO's critic runs on the workers
    with pytest.raises(ConfigError, match="critic.share_backbone"):
        build_config(PPOConfig, None, ["trainer.backend=ray", "critic.share_backbone=true"])
    with pytest.raises(ConfigError, match="placement.cpus_per_worker"):
        grpo("trainer.backend=ray", "placement.cpus_per_worker=0")
    with pytest.raises(ConfigError, match="trainer.backend"):
        grpo("trainer.backend=spark")
    ray = ("trainer.backend=ray", "trainer.n_workers_per_node=2")
    assert grpo(*ray, "rollout.seed_mode=row").rollout.split and not grpo(*ray).rollout.split  # auto
    assert not grpo(*ray, "rollout.seed_mode=row", "rollout.dispatch=rank_zero").rollout.split
    with pytest.raises(ConfigError, match="rollout.dispatch: .*rollout.seed_mode=row"):
        grpo(*ray, "rollout.dispatch=split")
    with pytest.raises(ConfigError, match="rollout.dispatch: .*trainer.backend=ray"):
        grpo("rollout.seed_mode=row", "rollout.dispatch=split")


def test_every_ray_only_key_is_refused_on_the_local_backend_by_one_check():
    """A veRL user's trainer.nnodes=2 trainer.n_workers_per_node=2 without trainer.backend=ray
    would train as one process: refused, naming both keys, as every key Ray alone reads."""
    with pytest.raises(ConfigError, match=r"^trainer.nnodes, trainer.n_workers_per_node: apply to Ray workers "
                                          r"only: set trainer.backend=ray, or drop them"):
        grpo("trainer.nnodes=2", "trainer.n_workers_per_node=2")
    for key, value in (("trainer.collective_timeout_s", 60), ("placement.cpus_per_worker", 2),
                       ("placement.gpus_per_worker", 1), ("placement.critic.n_workers_per_node", 2),
                       ("ray.address", "auto"), ("ray.num_cpus", 8)):
        with pytest.raises(ConfigError, match=rf"^{key}: applies to Ray workers only"):
            grpo(f"{key}={value}")
        grpo("trainer.backend=ray", f"{key}={value}")  # what Ray reads
    assert grpo("trainer.nnodes=1", "placement.cpus_per_worker=1").trainer.world_size == 1  # the defaults, said


def test_ray_num_cpus_is_for_a_ray_the_run_starts():
    assert grpo("trainer.backend=ray", "ray.num_cpus=64").ray.num_cpus == 64
    with pytest.raises(ConfigError, match=r"^ray.num_cpus: declares the CPUs of a Ray this run starts, but "
                                          r"ray.address=auto joins a cluster.*ray start --num-cpus=N"):
        grpo("trainer.backend=ray", "ray.address=auto", "ray.num_cpus=64")
    with pytest.raises(ConfigError, match="ray.num_cpus: must be >= 1"):
        grpo("trainer.backend=ray", "ray.num_cpus=0")


def test_gpu_workers_reserve_gpus_and_join_over_nccl_only_with_a_gpu_each():
    assert bundle(2, 0) == {"CPU": 2} and bundle(1, 0.5) == {"CPU": 1, "GPU": 0.5}
    assert collective_backend(1, cuda=True) == "nccl"
    assert collective_backend(0.5, cuda=True) == "gloo"  # two ranks on one GPU: NCCL refuses
    assert collective_backend(0, cuda=True) == collective_backend(1, cuda=False) == "gloo"
    with pytest.raises(ConfigError, match="placement.gpus_per_worker"):
        grpo("trainer.backend=ray", "placement.gpus_per_worker=-1")


def test_resource_pools_and_their_refusals_name_the_key():
    """veRL's resource_pool_spec + mapping from placement.*: colocated by default, the critic
    and the rollout on pools of their own on request; impossible layouts refused at config time."""
    pools, mapping = build_config(PPOConfig, None, ["trainer.backend=ray", "trainer.n_workers_per_node=2"]
                                  ).resource_pools()
    assert mapping == {"actor": "global_pool", "rollout": "global_pool", "critic": "global_pool"}
    assert list(pools) == ["global_pool"] and pools["global_pool"].world_size == 2
    cfg = build_config(PPOConfig, None, [
        "trainer.backend=ray", "placement.critic.enable_resource_pool=true",
        "placement.critic.n_workers_per_node=3", "placement.critic.cpus_per_worker=2",
        "placement.rollout.enable_resource_pool=true", "placement.rollout.nnodes=2", "placement.cpus_per_worker=3"])
    pools, mapping = cfg.resource_pools()
    assert mapping == {"actor": "global_pool", "rollout": "rollout_pool", "critic": "critic_pool"}
    critic, rollout = pools["critic_pool"], pools["rollout_pool"]
    assert (critic.world_size, critic.cpus_per_worker, critic.section, critic.cpus_key) == (
        3, 2, "placement.critic", "placement.critic.cpus_per_worker")
    assert (rollout.world_size, rollout.cpus_per_worker, rollout.cpus_key) == (2, 3, "placement.cpus_per_worker")
    assert grpo("trainer.backend=ray", "placement.rollout.enable_resource_pool=true").resource_pools()[1] == {
        "actor": "global_pool", "rollout": "rollout_pool"}
    refused = {
        "placement.critic.enable_resource_pool: algorithm.adv_estimator=grpo trains no critic": (
            GRPOConfig, ["trainer.backend=ray", "placement.critic.enable_resource_pool=true"]),
        "placement.rollout.enable_resource_pool: applies to Ray workers only: set trainer.backend=ray": (
            GRPOConfig, ["placement.rollout.enable_resource_pool=true"]),
        "placement.critic.n_workers_per_node: every worker needs a row": (  # 32 rows per mini-batch, 33 critic workers
            PPOConfig, ["trainer.backend=ray", "placement.critic.enable_resource_pool=true",
                        "placement.critic.n_workers_per_node=33"]),
        "placement.rollout.nnodes: must be >= 1": (GRPOConfig, ["placement.rollout.nnodes=0"]),
        "placement.critic.cpus_per_worker: must be >= 1 or null": (PPOConfig, ["placement.critic.cpus_per_worker=0"]),
    }
    for message, (cls, overrides) in refused.items():
        base = ["data.train_batch_size=2", "rollout.n=2", "actor.micro_batch_size=2"] if cls is GRPOConfig else []
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            build_config(cls, None, [*base, *overrides])


LOCAL_RUN = """
import os, sys, tempfile
from posttrain import GRPOConfig, GRPOTrainer
from posttrain.config import build_config
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinConfig, BuiltinLM

tok = build_tokenizer()
model = BuiltinLM(BuiltinConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0))
out = tempfile.mkdtemp()
cfg = build_config(GRPOConfig, None, ["rollout.n=2", "rollout.max_new_tokens=2", "data.train_batch_size=2",
                                      "actor.micro_batch_size=4", "trainer.max_steps=1", "trainer.save_steps=1",
                                      "trainer.report_to=[]", "trainer.progress=false", f"trainer.output_dir={out}"])
trainer = GRPOTrainer(model, reward_funcs=[lambda completions, **kw: [1.0] * len(completions)], args=cfg,
                      train_dataset=[{"prompt": "a b"}, {"prompt": "c"}], processing_class=tok)
assert type(trainer.roles.pools["global_pool"]).__name__ == "LocalWorkerGroup"
trainer.train()
assert os.path.isdir(os.path.join(out, "checkpoints", "step-1", "dcp", "actor"))  # the workers' layout
assert 'ray' not in sys.modules, 'ray imported'
"""


def test_the_local_backend_never_imports_ray():
    """A local run (one step and its checkpoint, on the one in-process worker) imports no Ray."""
    subprocess.run([sys.executable, "-c", LOCAL_RUN], check=True)


class Declared:
    """A worker whose methods declare their dispatch modes (`distributed.register`)."""

    def __init__(self, rank, world_size, collective, factor):
        self.factor, self.rank, self.calls = factor, rank, []

    @register(Dispatch.DP_COMPUTE, role="calc", name="compute")
    def calc_compute(self, batch):
        self.calls.append(("compute", len(batch)))
        return row_sums(batch) * self.factor

    @register(Dispatch.ONE_TO_ALL, role="calc")
    def scale(self, factor):
        self.factor = factor
        return self.rank

    @register(Dispatch.RANK_ZERO, Dispatch.DP_SPLIT, when="split", role="calc", collect=lambda parts: sum(parts, []))
    def tag(self, part, first, suffix):
        self.calls.append(("tag", first))
        return None if part is None else [(p + suffix, first + i) for i, p in enumerate(part.prompts)]

    @register(Dispatch.RANK_ZERO)
    def whoami(self):
        return self.rank


@pytest.mark.parametrize("split", [False, True])
def test_a_view_dispatches_each_method_as_it_declares(in_process_group, split):
    group = in_process_group(Declared, 3, 2)
    calc = role_view(group, Declared, "calc", {"split": split}, unit="rows")
    assert sorted(n for n in vars(calc) if callable(getattr(calc, n))) == ["compute", "scale", "tag"]
    assert calc.unit == "rows" and role_view(group, Declared).whoami() == 0
    assert calc.scale(5) == 0 and [w.factor for w in group.workers] == [5, 5, 5]  # ONE_TO_ALL: worker 0's result
    batch = rl_batch(7)
    torch.testing.assert_close(calc.compute(batch), row_sums(batch) * 5, rtol=0, atol=0)
    assert [w.calls[0] for w in group.workers] == [("compute", 3)] * 3  # 7 rows padded to 9, 3 each
    out = calc.tag(batch, "!")
    assert out == [(f"p{i}!", i) for i in range(7)]  # the same rows whichever mode
    tags = [c for w in group.workers for c in w.calls if c[0] == "tag"]
    assert tags == ([("tag", 0), ("tag", 3), ("tag", 5)] if split else [("tag", 0)])  # RANK_ZERO: worker 0, first 0


def test_a_second_mode_needs_its_flag():
    with pytest.raises(ValueError, match="when="):
        register(Dispatch.RANK_ZERO, Dispatch.DP_SPLIT)


def test_every_role_interface_method_is_generated_from_the_rl_worker():
    """The driver's typed roles (`workers.roles`) are what `RLWorker` declares, method for method."""
    from posttrain.trainers.rl_worker import RLWorker
    from posttrain.workers import roles

    group = LocalWorkerGroup(Doubler, 1)
    for role, protocol in {"actor": roles.ActorRole, "critic": roles.CriticRole, "ref": roles.ReferenceRole,
                           "rollout": roles.RolloutRole}.items():
        view = role_view(group, RLWorker, role)
        wanted = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
        assert wanted and wanted <= set(vars(view)), (role, wanted - set(vars(view)))
