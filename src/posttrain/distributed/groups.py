"""Worker groups: W workers, each holding one object built by a factory, called by method
name in veRL's dispatch modes (`dispatch`).

    group = RayWorkerGroup(GroupSpec(...), factory, *args)   # or LocalWorkerGroup(factory, *args)
    group.one_to_all("sync_weights")          # ONE_TO_ALL: [result of worker r for r < W]
                                              # (`register`: methods that declare their mode)
    group.rank_zero("generate", prompts, s)   # RANK_ZERO: worker 0's result
    group.dp_compute("logprobs", batch)       # DP_COMPUTE: pad, balance, split, run, gather
    group.dp_split("generate", prompts, s)    # DP_SPLIT: contiguous slices, each with its first row

`factory(rank, world_size, collective, *args)` runs in the worker's process and builds the
object (the RL worker: `trainers/rl_worker.py`); `collective` is a `Collective` over the
workers' gloo group that averages gradients (None in a local group). This layer knows no
role: the factory comes from above.

A `RayWorkerGroup` worker is a Ray actor in one bundle of its pool's placement group (one
bundle per worker, `ray_session.place`; `distributed.pools` places several pools at once;
GPU workers reserve `gpus_per_worker` GPUs, which Ray shows them as cuda:0, and join over
NCCL when each has a whole GPU), with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in its environment before it joins the group, torch threads set to its CPUs.

A worker that dies (killed, out of memory, its node lost) fails the call in flight within
seconds, not at the collective timeout: the results are awaited one at a time
(`ray.wait`), so a dead worker's ActorDiedError (Ray reports it within ~0.05 s) is seen
while its peers still wait in a gloo collective; the group then kills every worker (a
survivor blocked in a collective cannot be reached otherwise) and raises `WorkerDied`
naming the dead ranks, pids and roles; every later call of the group (from any thread) raises
that death again. `restart()` starts a new set of workers (in a new placement group) from the
arguments of the first start. A worker's process title names the method it runs
(`ray::RLWorker.generate`).
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from posttrain.distributed.dispatch import gather_rows, shard_rows, split_contiguous
from posttrain.user_code import UserCodeError

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

    def rank_zero(self, method: str, *args: Any) -> Any:
        return self._run_one(0, method, args)

    def dp_compute(self, method: str, batch: Any, *args: Any) -> Any:
        """`method(part, *args)` on each worker's balanced part of `batch`, gathered back in
        row order (`dispatch.shard_rows`, `dispatch.gather_rows`); one worker gets the batch
        itself (its one part, uncopied)."""
        if self.world_size == 1:
            return self._run(method, [(batch, *args)])[0]
        sharded = shard_rows(batch, self.world_size)
        return gather_rows(self._run(method, [(part, *args) for part in sharded.parts]), sharded)


    def dp_split(self, method: str, batch: Any, *args: Any) -> list[Any]:
        """`method(part, first, *args)` on each worker's contiguous slice of `batch` (`first`:
        the index of its first row; `dispatch.split_contiguous`); the results in slice order.
        A worker without rows gets part None and returns nothing that is kept."""
        parts = split_contiguous(batch, self.world_size)
        results = self._run(method, [(part, first, *args) for part, first in parts])
        return [out for (part, _), out in zip(parts, results) if part is not None]


class LocalWorkerGroup(_Dispatch):
    """One worker, in this process, no Ray: the same interface as `RayWorkerGroup`."""

    world_size = 1

    def __init__(self, factory: Factory, *args: Any):
        self.worker = factory(0, 1, None, *args)

    def _run(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]:
        return [getattr(self.worker, method)(*args_per_rank[0])]

    def _run_one(self, rank: int, method: str, args: tuple) -> Any:
        return getattr(self.worker, method)(*args)

    def close(self) -> None:
        """Nothing to stop: the worker is an object of this process (its models stay readable
        after the run, as a Python API user expects of `trainer.model`)."""


@dataclass(frozen=True)
class GroupSpec:
    """Where a Ray group's workers go (config keys in brackets; `section`.nnodes and
    `section`.n_workers_per_node size the pool: `trainer` for global_pool, `placement.critic`,
    `placement.rollout` for a role's own pool)."""

    nnodes: int  # trainer.nnodes
    workers_per_node: int  # trainer.n_workers_per_node
    cpus_per_worker: int  # placement.cpus_per_worker
    address: str | None  # ray.address
    num_cpus: int | None = None  # ray.num_cpus
    collective_timeout_s: float = 600.0  # trainer.collective_timeout_s
    placement_timeout_s: float = 10.0
    gpus_per_worker: float = 0.0  # placement.gpus_per_worker
    roles: str = ""
    """What each worker holds, for error messages (e.g. "actor, rollout, reference")."""
    restartable: bool = False
    """Keep the start's arguments in Ray's object store for `restart()` (trainer.on_worker_failure=restart)."""
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
        return Bundles(self.world_size, self.cpus_per_worker, shape, (workers, self.cpus_key), self.gpus_per_worker)


def collective_backend(gpus_per_worker: float, cuda: bool) -> str:
    """The workers' torch.distributed backend: NCCL when each has a GPU of its own (and CUDA is
    there), else gloo (CPU workers; workers sharing a GPU, where NCCL refuses two ranks on one
    device: gloo all-reduces CUDA tensors too)."""
    return "nccl" if cuda and gpus_per_worker >= 1 else "gloo"


DEATH_GRACE_S = 0.5
"""After a first worker death, how long to wait for the call's other workers to report theirs
(several workers killed together are named together); a peer's broken collective fails within
~0.5 s, and one still blocked is killed with the group."""
ECHO_GRACE_S = 10.0
"""After a worker's exception, how long to wait for a peer's death to be reported: a SIGKILLed
worker's sockets close at once, so its peers' gloo collectives may fail before Ray reports the
death (~0.05 s idle, longer on a loaded machine). A worker's own exception is raised this much
later when its peers wait for it in a collective."""


@dataclass(frozen=True)
class DeadWorker:
    """A worker whose process is gone."""

    rank: int
    pid: int | None
    """Its process (None: it died before it reported it)."""
    cause: str
    """Ray's error, shortened (`_reason`)."""


class WorkerDied(RuntimeError):
    """A worker of a `RayWorkerGroup` died during `method`; the group's workers are killed."""

    def __init__(self, dead: list[DeadWorker], world_size: int, roles: str, method: str):
        self.dead, self.world_size, self.roles, self.method = dead, world_size, roles, method
        who = "; ".join(f"rank {d.rank} (pid {d.pid})" for d in dead)
        holding = f" (holding {roles})" if roles else ""
        super().__init__(f"Ray worker{'s' if len(dead) > 1 else ''} {who} of {world_size}{holding} died during "
                         f"`{method}`: {dead[0].cause}")


def _deaths(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray's errors for a worker process that is gone (killed, out of memory, its node lost)."""
    e = ray.exceptions
    return e.RayActorError, e.WorkerCrashedError, e.OutOfMemoryError, e.NodeDiedError


def _reason(err: BaseException) -> str:
    """"ActorDiedError: <the line saying how the worker exited>", without Ray's list of usual causes."""
    text = str(err).strip()
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    reason = next((x for x in lines if "exit" in x.lower() or "killed" in x.lower()), lines[0] if lines else "")
    reason = reason.split(" Some common causes")[0].split(" There are some potential root causes")[0]
    return f"{type(err).__name__}: {reason[:240]}"


class _Worker:
    """The Ray actor of one worker: joins the gloo group, builds the object, runs its methods."""

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.obj: Any = None
        self.listener: socket.socket | None = None

    def master_address(self) -> tuple[str, int]:
        """This node's address (127.0.0.1 under a local Ray) and a port listening there only,
        for rank 0 to host the group's rendezvous store (`setup`)."""
        import ray

        addr = ray.util.get_node_ip_address()
        self.listener = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        self.listener.bind((addr, 0))
        self.listener.listen(128)
        return addr, self.listener.getsockname()[1]

    def setup(self, rank: int, world: int, local_rank: int, addr: str, port: int, timeout_s: float,
              gpus: float, factory: Factory, *args: Any) -> int:
        import torch
        import torch.distributed as dist

        from posttrain.distributed.collectives import Collective

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank), MASTER_ADDR=addr,
                          MASTER_PORT=str(port))
        if addr == "127.0.0.1" and os.path.isdir("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
        backend = collective_backend(gpus, torch.cuda.is_available())
        timeout = timedelta(seconds=timeout_s)
        # The store on the socket `master_address` bound: `init_method="tcp://..."` would make
        # torch listen on every interface (`*:port`), whatever the address.
        listen_fd = self.listener.detach() if self.listener is not None else None  # the store owns it now
        store = dist.TCPStore(addr, port, world, is_master=listen_fd is not None, timeout=timeout,
                              master_listen_fd=listen_fd, use_libuv=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        device = torch.device("cuda" if backend == "nccl" else "cpu")  # Ray shows each worker its GPU(s)
        collective = Collective(world, device, average_gradients=True)
        self.obj = factory(rank, world, collective, *args)
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        _set_title(f"ray::{type(self.obj).__name__}.{method}")
        return getattr(self.obj, method)(*args)


def _set_title(title: str) -> None:
    """The worker's process title while it runs a call: `ps` and `top` show `ray::RLWorker.generate`
    where Ray names every method of ours `ray::_Worker.call`. Ray's own setter, which puts its
    idle title back when the call returns; nothing where a Ray version lacks it."""
    import ray

    setter = getattr(ray._raylet, "setproctitle", None)
    if setter is not None:
        setter(title)


class RayWorkerGroup(_Dispatch):
    """`spec.world_size` Ray actors in one placement group, joined in one gloo group, each
    holding `factory(rank, W, collective, *args)`; the arguments are put in Ray's object
    store once. Placement fails in seconds with a ConfigError (`ray_session.place`), or
    `placement` is a placement group already made for this group (`distributed.pools`),
    which it then owns. `ready=False` leaves the workers joining: `wait_ready()` waits
    (several groups start at once). `close()` kills the workers, frees the placement group
    and stops a Ray it started; it also runs at interpreter exit."""

    def __init__(self, spec: GroupSpec, factory: Factory, *args: Any, placement: Any = None, ready: bool = True):
        from posttrain.distributed.ray_session import RaySession

        self.spec, self.world_size, self.factory = spec, spec.world_size, factory
        self.session = RaySession(spec.address, spec.num_cpus)
        self.actors: list[Any] = []
        self.pids: list[int | None] = []
        self.group, self._args = placement, None
        self._joining: dict[int, Any] = {}
        self.dead: WorkerDied | None = None
        """The death that stopped the workers: every later call raises it again, until `restart()`
        (another thread's call, e.g. async RL's rollout lane, then fails as the run's handler expects)."""
        atexit.register(self.close)
        try:
            refs = [self.session.ray.put(a) for a in args]
            self._args = refs if spec.restartable else None
            self._start(refs)
            if ready:
                self.wait_ready()
        except BaseException:
            self.close()
            raise

    def restart(self) -> None:
        """Kill the workers (dead or alive), free their placement group, and start new ones
        from the first start's arguments (`GroupSpec.restartable`)."""
        if self._args is None:
            raise RuntimeError("this worker group was not made restartable (GroupSpec.restartable)")
        self._stop_workers()
        self.dead = None
        try:
            self._start(self._args)
            self.wait_ready()
        except BaseException:
            self._stop_workers()  # `close()` (the run's `finally`) stops the rest
            raise

    def _start(self, refs: list[Any]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from posttrain.distributed.ray_session import place

        ray, s, factory = self.session.ray, self.spec, self.factory
        if self.group is None:  # given by `distributed.pools` at the first start
            self.group = place(ray, [s.bundles()], s.placement_timeout_s)[0]
        worker = ray.remote(_Worker)
        self.actors = [
            worker.options(num_cpus=s.cpus_per_worker, num_gpus=s.gpus_per_worker,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=i)).remote(s.cpus_per_worker)
            for i in range(self.world_size)
        ]
        self.pids = [None] * self.world_size
        addr, port = self._gather("master_address", {0: self.actors[0].master_address.remote()})[0]
        self._joining = {rank: a.setup.remote(rank, self.world_size, rank % s.workers_per_node, addr, port,
                                              s.collective_timeout_s, s.gpus_per_worker, factory, *refs)
                         for rank, a in enumerate(self.actors)}

    def wait_ready(self) -> None:
        """Wait until every worker joined the group and built its object (a death raises `WorkerDied`)."""
        pids = self._gather("setup", self._joining)
        self.pids = [pids[r] for r in range(self.world_size)]

    def one_to_all(self, method: str, *args: Any) -> list[Any]:
        """The arguments go to Ray's object store once, and every worker reads them there (not
        W copies from the driver: an update's whole batch goes to every worker, `DP_SHARES`)."""
        if self.world_size > 1:
            ref_type = self.session.ray.ObjectRef
            args = tuple(a if isinstance(a, ref_type) else self.session.ray.put(a) for a in args)
        return self._run(method, [args] * self.world_size)

    def _run(self, method: str, args_per_rank: Sequence[tuple]) -> list[Any]:
        self._check_alive()
        calls = {r: a.call.remote(method, *args) for r, (a, args) in enumerate(zip(self.actors, args_per_rank,
                                                                                  strict=True))}
        results = self._gather(method, calls)
        return [results[r] for r in range(self.world_size)]

    def _run_one(self, rank: int, method: str, args: tuple) -> Any:
        self._check_alive()
        return self._gather(method, {rank: self.actors[rank].call.remote(method, *args)})[rank]

    def _gather(self, method: str, calls: dict[int, Any]) -> dict[int, Any]:
        """{rank: result} of the calls in flight, taken as they finish, so the first worker
        death is seen at once (`ray.get` of the list would wait on a live worker blocked in a
        collective with the dead one). A death raises `WorkerDied` once the group is killed;
        a worker's own exception is raised as Ray raises it (the user's code's `UserCodeError`
        as itself), unless a peer died meanwhile (its broken collective is then only the echo
        of that death)."""
        ray = self.session.ray
        deaths = _deaths(ray)
        pending = {ref: rank for rank, ref in calls.items()}
        results: dict[int, Any] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done[0])
            try:
                results[rank] = ray.get(done[0])
            except deaths as err:
                self._died(method, [DeadWorker(rank, self.pids[rank], _reason(err)),
                                    *self._more_dead(pending, DEATH_GRACE_S)])
            except ray.exceptions.RayTaskError as err:
                if dead := self._more_dead(pending, ECHO_GRACE_S):
                    self._died(method, dead)
                if isinstance(err.cause, UserCodeError):  # said as the local backend says it
                    raise err.cause from None
                raise
        return results

    def _more_dead(self, pending: dict[Any, int], grace_s: float) -> list[DeadWorker]:
        """The workers among `pending` whose call ends in a death within `grace_s`."""
        ray, dead = self.session.ray, []
        deaths = _deaths(ray)
        deadline = time.monotonic() + grace_s
        while pending and (left := deadline - time.monotonic()) > 0:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not done:
                break
            rank = pending.pop(done[0])
            try:
                ray.get(done[0])
            except deaths as err:
                dead.append(DeadWorker(rank, self.pids[rank], _reason(err)))
                deadline = min(deadline, time.monotonic() + DEATH_GRACE_S)  # then only others dying with it
            except ray.exceptions.RayTaskError:
                pass  # a survivor whose collective broke
        return dead

    def _died(self, method: str, dead: list[DeadWorker]) -> None:
        self._stop_workers()  # survivors may wait in a collective for trainer.collective_timeout_s
        self.dead = WorkerDied(sorted(dead, key=lambda d: d.rank), self.world_size, self.spec.roles, method)
        raise self.dead

    def _check_alive(self) -> None:
        """Raise the death that stopped the workers (`dead`), as a new WorkerDied."""
        if self.dead is not None:
            d = self.dead
            raise WorkerDied(d.dead, d.world_size, d.roles, d.method)

    def _stop_workers(self) -> None:
        """Kill every worker (a busy one too) and free the placement group; Ray stays up."""
        ray = self.session.ray
        if ray.is_initialized():
            for a in self.actors:
                ray.kill(a)
            if self.group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
        self.actors, self.group = [], None

    def close(self) -> None:
        """Idempotent."""
        self._stop_workers()
        self._args = None
        self.session.close()
        atexit.unregister(self.close)
