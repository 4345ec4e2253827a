"""Bucketed weight streaming (`rollout/weight_stream.py`): the plan by hand, packing, and
two processes over gloo on 127.0.0.1 (forked: a spawned one would import torch again)."""

import io
import multiprocessing as mp
import os
import time

import pytest
import torch

from posttrain.rollout.weight_stream import (
    ALIGN,
    Bucket,
    TensorSpec,
    WeightGroup,
    listen,
    pack,
    plan_buckets,
    plan_from_json,
    plan_to_json,
    receive_buckets,
    send_buckets,
    tensor_specs,
    unpack,
)

FORK = mp.get_context("fork")


def named_tensors():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(10, generator=g)), ("b", torch.randn(3, 4, generator=g).bfloat16()),
            ("c", torch.arange(100)), ("d", torch.randn(2, 2, generator=g).double())]


def test_buckets_by_hand():
    """bucket_bytes 128: a f32 (10,) 40 B at 0, b bf16 (3,4) 24 B at 64 (aligned) -> 88 B; c int64
    (100,) 800 B is larger than a bucket: alone; d f64 (2,2) 32 B opens the third."""
    plan = plan_buckets(tensor_specs(named_tensors()), 128)
    assert ALIGN == 64
    assert plan == [
        Bucket(88, (TensorSpec("a", "float32", (10,), 0), TensorSpec("b", "bfloat16", (3, 4), 64))),
        Bucket(800, (TensorSpec("c", "int64", (100,), 0),)),
        Bucket(32, (TensorSpec("d", "float64", (2, 2), 0),)),
    ]
    assert len(plan_buckets(tensor_specs(named_tensors()), 10**6)) == 1
    assert plan_from_json(plan_to_json(plan)) == plan


def test_a_plan_that_points_outside_its_bucket_or_names_no_dtype_is_refused():
    good = plan_to_json(plan_buckets(tensor_specs(named_tensors()), 128))
    bad = [{**good[0], "nbytes": 80}]
    with pytest.raises(ValueError, match="b lies outside its bucket of 80 bytes"):
        plan_from_json(bad)
    with pytest.raises(ValueError, match="not a torch dtype"):
        plan_from_json([{"nbytes": 8, "tensors": [{"name": "x", "dtype": "Tensor", "shape": [2], "offset": 0}]}])
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([("x", "float32", (1,)), ("x", "float32", (1,))], 64)


def in_order(bucket, named):
    """The bucket's tensors of `named`, in its order, as `send_buckets` reads them."""
    tensors = dict(named)
    return iter([(s.name, tensors[s.name]) for s in bucket.tensors])


def test_pack_and_unpack_give_back_every_tensor_bit_for_bit_and_cast_floats_on_request():
    named = named_tensors()
    for bucket in plan_buckets(tensor_specs(named), 128):
        for name, t in unpack(bucket, pack(bucket, in_order(bucket, named), "cpu")):
            assert t.dtype == dict(named)[name].dtype and torch.equal(t, dict(named)[name])
    (bucket,) = plan_buckets(tensor_specs(named, "bfloat16"), 10**6)
    assert [s.dtype for s in bucket.tensors] == ["bfloat16", "bfloat16", "int64", "bfloat16"]
    out = dict(unpack(bucket, pack(bucket, in_order(bucket, named), "cpu")))
    assert torch.equal(out["a"], named[0][1].bfloat16()) and torch.equal(out["c"], named[2][1])
    with pytest.raises(ValueError, match="a: torch.float32 \\(10,\\) does not match the plan's float32 \\(11,\\)"):
        pack(Bucket(44, (TensorSpec("a", "float32", (11,), 0),)), iter(named), "cpu")


def _receiver(port, plan, results, die_early):
    group = WeightGroup.join("127.0.0.1", port, 1, 2, "gloo", timeout_s=20)
    if die_early:
        os._exit(0)  # gone without a word, as a killed server
    buf = io.BytesIO()  # bytes, not tensors: torch's queue pickler would share them by a file descriptor
    torch.save({name: t.clone() for name, t in receive_buckets(group.broadcast, plan, 0)}, buf)
    results.put(buf.getvalue())
    group.close()


def start_pair(plan, die_early=False):
    listener = listen("127.0.0.1")
    assert listener.getsockname()[0] == "127.0.0.1"
    results = FORK.Queue()
    child = FORK.Process(target=_receiver, args=(listener.getsockname()[1], plan, results, die_early))
    child.start()
    group = WeightGroup.join("127.0.0.1", listener.getsockname()[1], 0, 2, "gloo", timeout_s=20, listener=listener)
    return group, child, results


def test_two_processes_stream_every_tensor_over_gloo_in_buckets():
    named = named_tensors()
    plan = plan_buckets(tensor_specs(named), 128)
    group, child, results = start_pair(plan)
    try:
        sent = send_buckets(group.broadcast, named, plan, src=0)
        got = torch.load(io.BytesIO(results.get(timeout=20)))
    finally:
        child.join(10)
        group.close()
    assert sent == 88 + 800 + 32 and child.exitcode == 0
    assert list(got) == ["a", "b", "c", "d"]
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_a_receiver_that_dies_fails_the_senders_broadcast_in_seconds_not_at_the_timeout():
    big = [(f"w{i}", torch.zeros(2**18)) for i in range(8)]  # 8 MiB in 1 MiB buckets
    plan = plan_buckets(tensor_specs(big), 2**20)
    group, child, _ = start_pair(plan, die_early=True)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError):
            send_buckets(group.broadcast, big, plan, src=0)
    finally:
        child.join(10)
        group.close()
    assert time.monotonic() - start < 10  # the group's timeout is 20 s
