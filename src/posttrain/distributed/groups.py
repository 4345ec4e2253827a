"""Worker groups: W workers, each holding one object built by a factory, called by method
name in veRL's dispatch modes (`dispatch`).

    group = RayWorkerGroup(GroupSpec(...), factory, *args)   # or LocalWorkerGroup(factory, *args)
    group.one_to_all("sync_weights")          # ONE_TO_ALL: [result of worker r for r < W]
    group.rank_zero("generate", prompts, s)   # RANK_ZERO: worker 0's result
    group.rank_zero_ref("policy_weights")     # RANK_ZERO, the result left in Ray's object store
    group.dp_compute("logprobs", batch)       # DP_COMPUTE: pad, balance, split, run, gather
    group.per_rank("update", [args_0, ...])   # worker r gets args_r

`factory(rank, world_size, collective, *args)` runs in the worker's process and builds the
object (the colocated roles: `trainers/rl_ray.py`); `collective` is a `Collective` over the
workers' gloo group that averages gradients (None in a local group). This layer knows no
role: the factory comes from above.

A `RayWorkerGroup` worker is a Ray actor in one bundle of its pool's placement group (one
bundle per worker, `ray_session.place`; `distributed.pools` places several pools at once),
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment before it
joins the group, torch threads set to its CPUs.
"""

from __future__ import annotations

import atexit
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from posttrain.distributed.dispatch import gather_rows, shard_rows

Factory = Callable[..., Any]


class _Dispatch(ABC):
    """The dispatch modes over `_run(method, args_per_rank)` and `_run_one(rank, method, args)`."""

    world_size: int

    @abstractmethod
    def _run(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]: ...

    @abstractmethod
    def _run_one(self, rank: int, method: str, args: tuple) -> Any: ...

    def one_to_all(self, method: str, *args: Any) -> list[Any]:
        return self._run(method, [args] * self.world_size)

    def per_rank(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]:
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{method}: {len(args_per_rank)} argument sets for {self.world_size} workers")
        return self._run(method, args_per_rank)

    def rank_zero(self, method: str, *args: Any) -> Any:
        return self._run_one(0, method, args)

    @abstractmethod
    def rank_zero_ref(self, method: str, *args: Any) -> Any:
        """Worker 0's result as a handle another group's call takes as an argument (Ray: an
        ObjectRef, the result stored once in the object store and read by each receiving
        worker without passing through the driver; a local group: the result itself)."""

    def dp_compute(self, method: str, batch: Any, *args: Any) -> Any:
        """`method(part, *args)` on each worker's balanced part of `batch`, gathered back in
        row order (`dispatch.shard_rows`, `dispatch.gather_rows`)."""
        sharded = shard_rows(batch, self.world_size)
        return gather_rows(self._run(method, [(part, *args) for part in sharded.parts]), sharded)


class LocalWorkerGroup(_Dispatch):
    """One worker, in this process, no Ray: the same interface as `RayWorkerGroup`."""

    world_size = 1

    def __init__(self, factory: Factory, *args: Any):
        self.worker = factory(0, 1, None, *args)

    def _run(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]:
        return [getattr(self.worker, method)(*args_per_rank[0])]

    def _run_one(self, rank: int, method: str, args: tuple) -> Any:
        return getattr(self.worker, method)(*args)

    def rank_zero_ref(self, method: str, *args: Any) -> Any:
        return self._run_one(0, method, args)

    def close(self) -> None:
        self.worker = None


@dataclass(frozen=True)
class GroupSpec:
    """Where a Ray group's workers go (config keys in brackets; `section`.nnodes and
    `section`.n_workers_per_node size the pool: `trainer` for global_pool, `placement.critic`,
    `placement.rollout` for a role's own pool)."""

    nnodes: int  # trainer.nnodes
    workers_per_node: int  # trainer.n_workers_per_node
    cpus_per_worker: int  # placement.cpus_per_worker
    address: str | None  # ray.address
    collective_timeout_s: float = 600.0  # trainer.collective_timeout_s
    placement_timeout_s: float = 10.0
    section: str = "trainer"
    cpus_key: str = "placement.cpus_per_worker"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.workers_per_node

    def bundles(self) -> Any:
        """The pool's placement-group request (`ray_session.Bundles`), naming its config keys."""
        from posttrain.distributed.ray_session import Bundles

        workers = f"{self.section}.n_workers_per_node"
        shape = (f"{self.cpus_key}={self.cpus_per_worker} × {workers}={self.workers_per_node} × "
                 f"{self.section}.nnodes={self.nnodes}")
        return Bundles(self.world_size, self.cpus_per_worker, shape, (workers, self.cpus_key))


class _Worker:
    """The Ray actor of one worker: joins the gloo group, builds the object, runs its methods."""

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.obj: Any = None

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the group's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rank: int, world: int, local_rank: int, addr: str, port: int, timeout_s: float,
              factory: Factory, *args: Any) -> int:
        import torch
        import torch.distributed as dist

        from posttrain.distributed.collectives import Collective

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank), MASTER_ADDR=addr,
                          MASTER_PORT=str(port))
        if addr == "127.0.0.1" and os.path.isdir("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        collective = Collective(world, torch.device("cpu"), average_gradients=True)
        self.obj = factory(rank, world, collective, *args)
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.obj, method)(*args)


class RayWorkerGroup(_Dispatch):
    """`spec.world_size` Ray actors in one placement group, joined in one gloo group, each
    holding `factory(rank, W, collective, *args)`; the arguments are put in Ray's object
    store once. Placement fails in seconds with a ConfigError (`ray_session.place`), or
    `placement` is a placement group already made for this group (`distributed.pools`),
    which it then owns. `ready=False` leaves the workers joining: `wait_ready()` waits
    (several groups start at once). `close()` kills the workers, frees the placement group
    and stops a Ray it started; it also runs at interpreter exit."""

    def __init__(self, spec: GroupSpec, factory: Factory, *args: Any, placement: Any = None, ready: bool = True):
        from posttrain.distributed.ray_session import RaySession, place

        self.spec, self.world_size = spec, spec.world_size
        self.session = RaySession(spec.address)
        self.actors: list[Any] = []
        self.group = placement
        atexit.register(self.close)
        try:
            self._start(place, factory, args)
            if ready:
                self.wait_ready()
        except BaseException:
            self.close()
            raise

    def _start(self, place: Callable[..., Any], factory: Factory, args: tuple) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, s = self.session.ray, self.spec
        if self.group is None:
            self.group = place(ray, [s.bundles()], s.placement_timeout_s)[0]
        worker = ray.remote(_Worker)
        self.actors = [
            worker.options(num_cpus=s.cpus_per_worker, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=i)).remote(s.cpus_per_worker)
            for i in range(self.world_size)
        ]
        addr, port = ray.get(self.actors[0].master_address.remote())
        refs = [ray.put(a) for a in args]
        self._joining = [a.setup.remote(rank, self.world_size, rank % s.workers_per_node, addr, port,
                                        s.collective_timeout_s, factory, *refs) for rank, a in enumerate(self.actors)]

    def wait_ready(self) -> None:
        """Wait until every worker joined the group and built its object."""
        self.pids = self.session.ray.get(self._joining)

    def _run(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]:
        ray = self.session.ray
        return ray.get([a.call.remote(method, *args) for a, args in zip(self.actors, args_per_rank, strict=True)])

    def _run_one(self, rank: int, method: str, args: tuple) -> Any:
        return self.session.ray.get(self.actors[rank].call.remote(method, *args))

    def rank_zero_ref(self, method: str, *args: Any) -> Any:
        return self.actors[0].call.remote(method, *args)

    def close(self) -> None:
        """Idempotent."""
        ray = self.session.ray
        if ray.is_initialized():
            for a in self.actors:
                ray.kill(a)
            if self.group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
        self.actors, self.group = [], None
        self.session.close()
        atexit.unregister(self.close)
