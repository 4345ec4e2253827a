"""The actor side of a rollout pool's weight sync with a sharded policy (`RLWorker.send_weights`:
`fsdp.full_tensors` into `weight_stream.send_buckets`), in processes on 127.0.0.1: two FSDP2
ranks over gloo gather each parameter in turn, rank 0 sends the buckets over a weight group
to a receiver (this process), whose zeroed copy (`receive_into`) gets the unsharded model's weights bit for bit. Rank 0
never holds more than one gathered parameter and one bucket. The run's exactness with a
rollout pool: tests/trainers/test_rl_ray.py and test_rl_fsdp.py."""

import multiprocessing as mp
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401  (imported once, before the ranks fork)

from posttrain.distributed.fsdp import full_tensors, shard_model
from posttrain.models import BuiltinLM
from posttrain.rollout.weight_stream import (
    WeightGroup,
    listen,
    plan_buckets,
    receive_into,
    send_buckets,
    tensor_specs,
)

FORK = mp.get_context("fork")  # a spawned process would import torch again (seconds)
BUCKET = 8192
"""Bytes: the tiny model's 2-4 KiB parameters, 2 to 4 to a bucket."""


def tiny():
    torch.manual_seed(0)
    return BuiltinLM.from_preset("tiny", vocab_size=16, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                 num_attention_heads=2, num_key_value_heads=2).double()


def _actor_rank(rank, fsdp_sock, weight_sock, plan, out):
    """FSDP2 rank `rank` of 2; rank 0 also hosts the weight group and sends (as `send_weights`)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    port, wait = fsdp_sock.getsockname()[1], timedelta(seconds=20)
    fd = fsdp_sock.detach() if rank == 0 else None
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, master_listen_fd=fd, timeout=wait,
                          use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=wait)
    model = shard_model(tiny())
    if rank == 1:
        for _ in full_tensors(model, buffers=False):  # its part of each gather
            pass
        dist.destroy_process_group()
        return
    group = WeightGroup.join("127.0.0.1", weight_sock.getsockname()[1], 0, 2, "gloo", 20, listener=weight_sock)
    live: weakref.WeakSet = weakref.WeakSet()  # the gathered parameters still alive
    seen = []  # at each broadcast: (gathered parameters alive, the bucket's bytes)

    def tracked(named):
        for name, t in named:
            live.add(t)
            yield name, t

    def broadcast(buf, src):
        seen.append((len(live), buf.numel()))
        group.broadcast(buf, src)

    same_plan = plan_buckets(tensor_specs(model.named_parameters()), BUCKET) == plan  # full shapes of the shards
    send_buckets(broadcast, tracked(full_tensors(model, buffers=False)), plan, 0)
    out.put((same_plan, seen))
    group.close()
    dist.destroy_process_group()


def test_sharded_actor_ranks_stream_full_weights_one_parameter_and_one_bucket_at_a_time():
    plain = tiny()
    params = dict(plain.named_parameters())
    plan = plan_buckets(tensor_specs(params.items()), BUCKET)
    assert len(plan) >= 3 and max(len(b.tensors) for b in plan) >= 2
    fsdp_sock, weight_sock = listen("127.0.0.1"), listen("127.0.0.1")
    out = FORK.Queue()
    ranks = [FORK.Process(target=_actor_rank, args=(r, fsdp_sock, weight_sock, plan, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    port = weight_sock.getsockname()[1]
    fsdp_sock.close()
    weight_sock.close()  # rank 0's store holds its own copy
    try:
        group = WeightGroup.join("127.0.0.1", port, 1, 2, "gloo", timeout_s=20)
        copy = tiny()  # a rollout worker's policy copy, zeroed: every weight must arrive
        with torch.no_grad():
            for p in copy.parameters():
                p.zero_()
        receive_into(group.broadcast, plan, 0, dict(copy.named_parameters()))
        got = dict(copy.named_parameters())
        same_plan, seen = out.get(timeout=20)
        group.close()
    finally:
        for p in ranks:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    assert same_plan  # rank 0 plans from its shards' full shapes: the receiver's plan
    assert got.keys() == params.keys()
    for name, t in params.items():
        assert torch.equal(got[name], t.detach()), name
    largest = max(t.numel() * t.element_size() for t in params.values())
    assert len(seen) == len(plan)
    assert all(alive <= 1 for alive, _ in seen), seen  # the old dict(named) held all 19 when the first bucket left
    assert all(nbytes <= max(BUCKET, largest) for _, nbytes in seen)
