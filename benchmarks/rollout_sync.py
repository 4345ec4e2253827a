"""A rollout pool's weight sync (placement.rollout.enable_resource_pool): time and peak memory
of the bucketed stream (`rl_roles.PoolSync`, issue 32 item 4) against the path it replaced
(actor worker 0's whole state dict through Ray's object store), side by side in one run.

    PYTHONPATH=src .venv/bin/python benchmarks/rollout_sync.py [--preset small] [--syncs 5] [--bucket-mb 16]

Each path runs on fresh Ray workers (one process each, 1 CPU, 1 torch thread) holding the
built-in `--preset` model in float32: the actor side (1 worker, or 2 FSDP2 workers that each
hold half of every parameter) and one rollout worker with its own whole copy. Per sync, the
calls the RL worker makes (`RLWorker.send_weights` / `receive_weights`):

- `object-store` (before): worker 0 returns `{name: tensor.cpu()}` of its state dict (left in
  Ray's object store), the rollout worker takes that ObjectRef as its argument and
  `load_state_dict`s it (the old `policy_weights` → `load_weights`);
- `stream`: worker 0 (`fsdp2`: both workers gather each parameter in turn, `full_tensors`)
  packs buckets of --bucket-mb and broadcasts them over a gloo group joining it and the
  rollout worker, which copies each bucket's tensors into its parameters (`send_buckets`,
  `receive_buckets`).

Reported: the median seconds of --syncs syncs (after one warm-up sync, not timed), and each
process's peak resident memory over all 1 + --syncs syncs above its resident memory before
the first (`VmHWM` after `VmRSS`, the peak reset first through /proc/self/clear_refs), in
MiB: the driver, actor worker 0 (and 1), and the rollout worker. Freed buffers the allocator
keeps count (glibc keeps large freed blocks up to its trim threshold). Ray's object store
(plasma, shared memory) is counted where a process maps its pages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch


def status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int:
    """Reset this process's VmHWM to its current RSS (Linux: clear_refs 5); returns the RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


class Side:
    """One benchmark worker (`RayWorkerGroup` factory): an actor rank or the rollout worker."""

    def __init__(self, rank: int, world: int, collective: Any, preset: str, sharded: bool):
        from posttrain.distributed.fsdp import shard_model
        from posttrain.models import BuiltinLM

        torch.manual_seed(0)
        self.rank, self.sharded = rank, sharded
        self.model = BuiltinLM.from_preset(preset, vocab_size=320)
        if sharded:
            shard_model(self.model)
        self.group = self.plan = self.listener = None
        self.before = 0

    def mark(self) -> int:
        self.before = reset_peak()
        return self.before

    def peak_mib(self) -> float:
        return (status_kib("VmHWM") - self.before) / 1024

    def parameters_mib(self) -> float:
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2**20

    # the stream (RLWorker.host_weights / join_weights / send_weights / receive_weights)

    def host(self, bucket_bytes: int) -> dict:
        from posttrain.rollout.weight_stream import listen, plan_buckets, plan_to_json, tensor_specs

        self.listener = listen("127.0.0.1")
        self.plan = plan_buckets(tensor_specs(self.model.named_parameters()), bucket_bytes)
        return {"port": self.listener.getsockname()[1], "plan": plan_to_json(self.plan)}

    def join(self, port: int, rank: int, world: int, plan: list | None = None) -> None:
        from posttrain.rollout.weight_stream import WeightGroup, plan_from_json

        listener, self.listener = self.listener, None
        self.group = WeightGroup.join("127.0.0.1", port, rank, world, "gloo", 120, listener)
        self.plan = plan_from_json(plan) if plan is not None else self.plan

    def send(self) -> None:
        from posttrain.distributed.fsdp import full_tensors
        from posttrain.rollout.weight_stream import send_buckets

        named = full_tensors(self.model, buffers=False) if self.sharded else self.model.named_parameters()
        if self.rank == 0:
            send_buckets(self.group.broadcast, named, self.plan, 0, self.group.device)
        else:
            for _ in named:
                pass

    def receive(self) -> None:
        from posttrain.rollout.weight_stream import receive_into

        receive_into(self.group.broadcast, self.plan, 0, dict(self.model.named_parameters()), self.group.device)

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()

    # the object store (the removed `policy_weights` / `load_weights`)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)


def measure(path: str, actors: int, preset: str, syncs: int, bucket_bytes: int) -> dict:
    from posttrain.distributed.groups import GroupSpec, RayWorkerGroup
    from posttrain.trainers.rl_roles import together

    sharded = actors > 1
    actor = RayWorkerGroup(GroupSpec(1, actors, 1, None), Side, preset, sharded)
    rollout = RayWorkerGroup(GroupSpec(1, 1, 1, None), Side, preset, False)
    try:
        if path == "stream":
            host = actor.rank_zero("host", bucket_bytes)
            together(lambda: actor.rank_zero("join", host["port"], 0, 2),
                     lambda: rollout.one_to_all("join", host["port"], 1, 2, host["plan"]))

            def sync() -> None:
                together(lambda: actor.one_to_all("send"), lambda: rollout.one_to_all("receive"))
        else:
            def sync() -> None:
                ref = actor.actors[0].call.remote("state")  # left in the object store, as RANK_ZERO_REF did
                rollout.one_to_all("load", ref)
                del ref

        driver_before = reset_peak()  # before the first sync: what the allocator keeps after it counts
        actor.one_to_all("mark")
        rollout.one_to_all("mark")
        sync()  # warm-up (first gathers, first buckets), not timed
        times = []
        for _ in range(syncs):
            t0 = time.perf_counter()
            sync()
            times.append(time.perf_counter() - t0)
        out = {"path": path + (f" fsdp2 x{actors}" if sharded else ""), "sync_s": statistics.median(times),
               "params_mib": rollout.rank_zero("parameters_mib"),
               "driver_peak_mib": (status_kib("VmHWM") - driver_before) / 1024,
               **{f"actor{r}_peak_mib": v for r, v in enumerate(actor.one_to_all("peak_mib"))},
               "rollout_peak_mib": rollout.rank_zero("peak_mib")}
        if path == "stream":
            together(lambda: actor.one_to_all("leave"), lambda: rollout.one_to_all("leave"))
        return out
    finally:
        actor.close()
        rollout.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=16.0)
    p.add_argument("--out", default=None, help="a JSON file for the rows")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from posttrain.distributed.ray_session import RaySession

    session = RaySession(None, num_cpus=4)
    rows = []
    try:
        for path, actors in (("object-store", 1), ("stream", 1), ("stream", 2)):
            rows.append(measure(path, actors, args.preset, args.syncs, int(args.bucket_mb * 2**20)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        session.close()
    print(f"\n| path | sync s (median of {args.syncs}) | driver | actor 0 | actor 1 | rollout worker |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['sync_s']:.3f} | {r['driver_peak_mib']:.1f} | {r['actor0_peak_mib']:.1f} | "
              f"{r.get('actor1_peak_mib', float('nan')):.1f} | {r['rollout_peak_mib']:.1f} |")
    print(f"(peak MiB above each process's RSS before the syncs; the model's parameters: {rows[0]['params_mib']:.1f} MiB)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
