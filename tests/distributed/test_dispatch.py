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


def test_the_local_backend_never_imports_ray():
    code = ("import sys; import posttrain, posttrain.trainers.rl, posttrain.distributed; "
            "from posttrain.config import build_config; from posttrain.config.rl import GRPOConfig; "
            "build_config(GRPOConfig, None, []); assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
