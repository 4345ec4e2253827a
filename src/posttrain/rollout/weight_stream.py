"""Weights from one process to others in flat buckets, over a process group of their own.

    plan = plan_buckets(tensor_specs(named), bucket_bytes=256 * 2**20)   # every rank holds the plan
    group = WeightGroup.join(addr, port, rank, world_size, "gloo")      # rank 0 hosts the rendezvous
    send_buckets(group.broadcast, named, plan, src=0)                    # the source rank
    for name, tensor in receive_buckets(group.broadcast, plan, 0, dev):  # every other rank
        ...

What uses it: the trainer's weight sync to a vLLM server (`rollout.vllm_mode=server`,
`rollout/vllm_server.py`), and the actor's weights to a rollout pool of its own
(`placement.rollout.enable_resource_pool`, `trainers/rl_worker.py`): both in buckets of
rollout.sync_bucket_mb.

- A bucket is one flat uint8 buffer: each tensor's bytes at an offset aligned to `ALIGN` bytes
  (so every dtype views its slice in place), tensors of any dtypes mixed. Tensors go in the
  order given, a new bucket when the next one would pass `bucket_bytes`; a tensor larger than
  that has a bucket of its own. One broadcast per bucket: few large messages instead of one per
  parameter (TRL's `update_named_param`), and the receiver holds one bucket at a time beyond
  its own weights.
- The plan (names, dtypes, shapes, offsets) is plain data (`plan_to_json`): it travels by
  other means (an HTTP request) or is computed by every rank from the same tensor list.
- `broadcast(tensor, src)` is all this needs of a group: `WeightGroup.broadcast` (a group of
  its own, below) or, inside torch.distributed's default world,
  `lambda t, src: dist.broadcast(t, src, group=g)`.
- `WeightGroup`: gloo (CPU buffers) or NCCL (CUDA buffers) over a TCPStore that rank 0 hosts
  on a socket bound to the given address only (`listen`), with a prefix of its own. It does not
  touch torch.distributed's default group, which the trainer (DDP) or vLLM's workers (their
  tensor-parallel world) already use. A peer that dies fails a collective when its connection
  drops; one that never joins, after `timeout_s`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

ALIGN = 64
"""Byte alignment of each tensor inside a bucket (any dtype's element size divides it)."""

Broadcast = Callable[[torch.Tensor, int], None]
"""`broadcast(tensor, src)`: rank src's tensor into every rank's `tensor`, in place."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lies in its bucket."""

    name: str
    dtype: str
    """torch dtype without the `torch.` prefix: float32, bfloat16, ..."""
    shape: tuple[int, ...]
    offset: int
    """Its first byte in the bucket."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=dtype_of(self.dtype)).element_size()


@dataclass(frozen=True)
class Bucket:
    """One broadcast: `nbytes` bytes holding `tensors`."""

    nbytes: int
    tensors: tuple[TensorSpec, ...]


def dtype_of(name: str) -> torch.dtype:
    """`float32` -> torch.float32; anything that is not a torch dtype is a ValueError."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def tensor_specs(named: Iterable[tuple[str, torch.Tensor]], float_dtype: str | None = None
                 ) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of each tensor, in order: what `plan_buckets` packs. With
    `float_dtype` (e.g. "bfloat16": what the receiver computes in), floating tensors travel in
    it (`pack` casts them one at a time), halving a float32 policy's bytes."""
    def wire(t: torch.Tensor) -> str:
        return float_dtype if float_dtype is not None and t.is_floating_point() else str(t.dtype)

    return [(name, wire(t).removeprefix("torch."), tuple(t.shape)) for name, t in named]


def plan_buckets(specs: Sequence[tuple[str, str, Sequence[int]]], bucket_bytes: int) -> list[Bucket]:
    """Cut (name, dtype, shape) specs, in order, into buckets of at most `bucket_bytes` each
    (a tensor larger than that alone in its bucket); offsets aligned to `ALIGN`.

    Example, bucket_bytes=128: float32 (10,) [40 B] and (20,) [80 B] -> one bucket of 144 B
    (offsets 0 and 64), then a float32 (40,) [160 B] -> a bucket of its own of 160 B.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("plan_buckets: a tensor name appears twice")
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    end = 0
    for name, dtype, shape in specs:
        size = TensorSpec(name, dtype, tuple(shape), 0).nbytes
        offset = _aligned(end)
        if current and offset + size > bucket_bytes:
            buckets.append(Bucket(end, tuple(current)))
            current, offset = [], 0
        current.append(TensorSpec(name, dtype, tuple(int(d) for d in shape), offset))
        end = offset + size
    if current:
        buckets.append(Bucket(end, tuple(current)))
    return buckets


def plan_to_json(plan: Sequence[Bucket]) -> list[dict]:
    """The plan as JSON-ready lists and dicts (`plan_from_json` reads it back)."""
    return [asdict(b) for b in plan]


def plan_from_json(data: Sequence[dict]) -> list[Bucket]:
    """A plan from `plan_to_json`'s output, every field checked."""
    plan = []
    for b in data:
        tensors = tuple(TensorSpec(str(t["name"]), str(t["dtype"]), tuple(int(d) for d in t["shape"]),
                                   int(t["offset"])) for t in b["tensors"])
        bucket = Bucket(int(b["nbytes"]), tensors)
        for t in tensors:
            dtype_of(t.dtype)
            if t.offset % ALIGN or t.offset + t.nbytes > bucket.nbytes:
                raise ValueError(f"weight plan: {t.name} lies outside its bucket of {bucket.nbytes} bytes")
        plan.append(bucket)
    return plan


def pack(bucket: Bucket, named: Iterator[tuple[str, torch.Tensor]], device: torch.device | str) -> torch.Tensor:
    """The bucket's (nbytes,) uint8 buffer on `device`, filled from `named`, which yields its
    tensors in the bucket's order, each in the spec's dtype (a floating tensor is cast; any other
    must have it already). Exactly the bucket's tensors are read from `named`, one at a time: a
    generator that gathers each as it is asked for has one alive here."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for spec in bucket.tensors:
        name, t = next(named, (None, None))
        if name != spec.name:
            raise ValueError(f"send_buckets: the plan's next tensor is {spec.name}, the weights give "
                             f"{name or 'none'} (the plan is made from the same tensors, in order)")
        _put(buf, spec, t)
        del t  # a gathered tensor goes before the next is gathered
    return buf


def _put(buf: torch.Tensor, spec: TensorSpec, t: torch.Tensor) -> None:
    """`t`'s bytes, in the spec's dtype, into its slice of the bucket buffer `buf`."""
    t, dtype = t.detach(), dtype_of(spec.dtype)
    if tuple(t.shape) != spec.shape or (t.dtype != dtype and not (t.is_floating_point() and dtype.is_floating_point)):
        raise ValueError(f"{spec.name}: {t.dtype} {tuple(t.shape)} does not match the plan's {spec.dtype} "
                         f"{spec.shape}")
    data = t.to(device=buf.device, dtype=dtype).contiguous().reshape(-1).view(torch.uint8)
    buf[spec.offset: spec.offset + spec.nbytes].copy_(data)


def unpack(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for the bucket's specs: views into `buf` (no copy)."""
    return [(s.name, buf[s.offset: s.offset + s.nbytes].view(dtype_of(s.dtype)).view(s.shape))
            for s in bucket.tensors]


def send_buckets(broadcast: Broadcast, named: Iterable[tuple[str, torch.Tensor]], plan: Sequence[Bucket],
                 src: int, device: torch.device | str = "cpu") -> int:
    """Broadcast every bucket of `plan` from this rank (`src`), filled on `device` (the group's:
    cpu for gloo, cuda for NCCL) from `named`, read lazily in the plan's order: a generator
    that gathers each tensor as it is asked for (`fsdp.full_tensors`) has at most one tensor
    and one bucket alive here. Returns the bytes sent."""
    stream = iter(named)
    for bucket in plan:
        broadcast(pack(bucket, stream, device), src)
    if next(stream, None) is not None:
        raise ValueError("send_buckets: the weights hold more tensors than the plan")
    return sum(b.nbytes for b in plan)


def receive_buckets(broadcast: Broadcast, plan: Sequence[Bucket], src: int,
                    device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the plan's buckets from rank `src`, one at a time on `device`, yielding each
    tensor (a view into its bucket's buffer) as its bucket arrives. Lazy: a consumer that
    loads as it goes holds one bucket at a time."""
    for bucket in plan:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        broadcast(buf, src)
        yield from unpack(bucket, buf)
        del buf  # let go before the next bucket's buffer is made


@torch.no_grad()
def receive_into(broadcast: Broadcast, plan: Sequence[Bucket], src: int, params: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu") -> None:
    """Receive the plan's buckets from rank `src` and copy each tensor into `params[name]` (a
    module's parameters, any device and float dtype) as its bucket arrives: one bucket held at
    a time beyond `params`."""
    for name, t in receive_buckets(broadcast, plan, src, device):
        params[name].copy_(t)
        del t  # the bucket goes once its last view does


# ---------------------------------------------------------------- a group of its own


def listen(addr: str) -> socket.socket:
    """A socket bound to `addr` only, on a free port, listening: rank 0's rendezvous store
    takes it over (`WeightGroup.join(listener=...)`), so no other interface is opened and no
    other process can take the port in between."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.bind((addr, 0))
    sock.listen(128)
    return sock


class WeightGroup:
    """`world_size` processes joined for broadcasts (gloo or nccl), outside torch.distributed's
    default group. Every rank calls `join` with the same address, port and world size; rank 0
    passes the `listen` socket whose port the others were told."""

    def __init__(self, backend_pg, rank: int, world_size: int, backend: str, store) -> None:
        self.pg, self.rank, self.world_size, self.backend = backend_pg, rank, world_size, backend
        self._store = store  # kept alive: the group talks through it while it lives

    @property
    def device(self) -> torch.device:
        """Where the group's buffers live: cuda for nccl, cpu for gloo."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    @classmethod
    def join(cls, addr: str, port: int, rank: int, world_size: int, backend: str = "gloo",
             timeout_s: float = 600.0, listener: socket.socket | None = None) -> WeightGroup:
        """Join (rank 0: host, on `listener`) the group; returns once all `world_size` ranks have."""
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
        if (listener is not None) != (rank == 0):
            raise ValueError("rank 0, and only rank 0, hosts the store on its listener socket")
        timeout = timedelta(seconds=timeout_s)
        fd = listener.detach() if listener is not None else None  # the store owns it now
        store = dist.TCPStore(addr, port, world_size, is_master=fd is not None, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=fd, use_libuv=False)
        prefixed = dist.PrefixStore("posttrain-weights", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [_gloo_device(addr)]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        group = cls(pg, rank, world_size, backend, store)
        group.barrier()  # every rank has joined
        return group

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        opts = torch.distributed.AllreduceOptions()
        self.pg.allreduce([flag], opts).wait()

    def close(self) -> None:
        """Leave the group (the peers' next collective then fails)."""
        if self.pg is not None:
            shutdown = getattr(self.pg, "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.pg = self._store = None


def _gloo_device(addr: str):
    """Gloo's transport on the interface of `addr` (loopback for 127.0.0.1), not the one the
    hostname resolves to; GLOO_SOCKET_IFNAME, when set, wins."""
    import torch.distributed as dist

    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname)
    return dist.ProcessGroupGloo.create_device(hostname=addr)
