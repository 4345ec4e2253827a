"""A rollout pool's weights (placement.rollout.enable_resource_pool), the RL worker's side
(`rl_worker.RLWorker` inherits it; the driver's side is `rl_roles.PoolSync`).

    actor worker 0                                   rollout worker r (of R)
    host_weights(bucket_bytes) → addr, port, plan
    join_weights(world=1+R, ...)    rank 0 ◄─ weight group ─► rank 1+r   join_weights(addr, port, ..., plan)
    send_weights()  [every actor worker gathers]   buckets ─►             receive_weights()
    stage_weights(v) / send_staged(v)  (async RL: the weights of update v, sent later)
    leave_weights()  (every worker of every pool: the run's end, or before a new group)

The buckets are `rollout/weight_stream.py`'s (the vLLM server mode's streamer): worker 0 fills
each as it reads the parameters one at a time (fsdp2: `full_tensors`, an all-gather per
parameter over the actor pool), and a rollout worker copies each bucket's tensors into its
policy copy before the next arrives.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from posttrain.distributed.fsdp import full_tensors
from posttrain.distributed.register import Dispatch, register
from posttrain.rollout.weight_stream import (
    Bucket,
    WeightGroup,
    listen,
    plan_buckets,
    plan_from_json,
    plan_to_json,
    receive_into,
    send_buckets,
    tensor_specs,
)


class PoolWeights:
    """The weight-group methods of an RL worker: it has `rank`, `sharded`, `actor` (actor
    pool), `policy` and `rollout` (rollout pool)."""

    rank: int
    sharded: bool
    actor: Any
    policy: Any
    rollout: Any

    def init_pool_weights(self) -> None:
        self.weights: tuple[WeightGroup, list[Bucket]] | None = None
        """The weight group (actor worker 0 and the rollout workers) and the buckets' plan, once joined."""
        self.staged: dict[int, list[tuple[str, torch.Tensor]]] = {}
        """Async RL (actor worker 0): weights kept, by version, until sent."""
        self._listener: Any = None  # actor worker 0, between `host_weights` and `actor_join_weights`
        self._plan: list[Bucket] = []

    # ------------------------------------------------------------------ actor side

    @register(Dispatch.RANK_ZERO, role="actor", name="host_weights")
    def host_weights(self, bucket_bytes: int) -> dict[str, Any]:
        """Actor worker 0 opens the weight group's rendezvous on its node's address (the Ray
        group's: 127.0.0.1 under a local Ray) and cuts the policy's parameters (their full
        shapes, sharded or not) into buckets: {"addr", "port", "plan"} for the rollout workers."""
        self.leave_weights()
        self._listener = listen(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self._plan = plan_buckets(tensor_specs(self.actor.model.named_parameters()), bucket_bytes)
        addr, port = self._listener.getsockname()[:2]
        return {"addr": addr, "port": port, "plan": plan_to_json(self._plan)}

    @register(Dispatch.RANK_ZERO, role="actor", name="join_weights")
    def actor_join_weights(self, world: int, backend: str, timeout_s: float) -> None:
        """Actor worker 0 hosts the weight group (rank 0) on the socket `host_weights` opened."""
        listener, self._listener = self._listener, None
        addr, port = listener.getsockname()[:2]
        self.weights = (WeightGroup.join(addr, port, 0, world, backend, timeout_s, listener), self._plan)

    def _named_full(self) -> Any:
        """The policy's (name, whole parameter), one at a time: under fsdp2 every worker gathers
        each in turn (collective), else this worker's own."""
        model = self.actor.model
        return full_tensors(model, buffers=False) if self.sharded else model.named_parameters()

    @register(Dispatch.ONE_TO_ALL, role="actor", name="send_weights")
    def send_weights(self) -> None:
        """The actor's current weights to the rollout pool, from worker 0 in buckets (`send_buckets`
        reads each parameter as its bucket fills: one gathered parameter and one bucket at a
        time); the other workers take their part in each gather."""
        named = self._named_full()
        if self.rank == 0:
            self._send(named)
        else:
            _drain(named)

    @register(Dispatch.ONE_TO_ALL, role="actor", name="stage_weights")
    def stage_weights(self, version: int) -> None:
        """Async RL: worker 0 keeps a CPU copy of the current weights as `version` (sent later,
        `send_staged`, while the next update changes the live ones); every worker gathers."""
        named = self._named_full()
        if self.rank == 0:
            self.staged[version] = [(name, t.detach().to("cpu", copy=True)) for name, t in named]
        else:
            _drain(named)

    @register(Dispatch.RANK_ZERO, role="actor", name="send_staged")
    def send_staged(self, version: int) -> None:
        self._send(self.staged.pop(version))

    def _send(self, named: Any) -> None:
        group, plan = self._joined()
        try:
            send_buckets(group.broadcast, named, plan, 0, group.device)
        except BaseException:
            self.leave_weights()
            raise

    # ------------------------------------------------------------------ rollout side

    @register(Dispatch.ONE_TO_ALL, role="rollout", name="join_weights")
    def rollout_join_weights(self, addr: str, port: int, world: int, backend: str, timeout_s: float,
                             plan: list[dict]) -> None:
        """A rollout pool's worker r joins actor worker 0's weight group as rank 1 + r; the
        plan must name exactly its policy copy's parameters."""
        self.leave_weights()
        group = WeightGroup.join(addr, port, 1 + self.rank, world, backend, timeout_s)
        self.weights = (group, plan_from_json(plan))
        planned = {t.name for b in self.weights[1] for t in b.tensors}
        ours = {name for name, _ in self.policy.named_parameters()}
        if planned != ours:
            self.leave_weights()
            raise ValueError(f"the actor's weights ({len(planned)} tensors) are not the rollout pool's policy "
                             f"({len(ours)}): missing {sorted(ours - planned)[:3]}, unknown {sorted(planned - ours)[:3]}")

    @register(Dispatch.ONE_TO_ALL, role="rollout", name="receive_weights")
    def receive_weights(self) -> None:
        """A rollout pool's worker: its policy copy takes the actor's weights bucket by bucket
        (one bucket held at a time), then its engine samples from them. A broken stream leaves
        the group (its peers' broadcasts then fail too)."""
        group, plan = self._joined()
        try:
            receive_into(group.broadcast, plan, 0, dict(self.policy.named_parameters()), group.device)
        except BaseException:
            self.leave_weights()
            raise
        self.rollout.sync_weights(self.policy)

    def _joined(self) -> tuple[WeightGroup, list[Bucket]]:
        if self.weights is None:
            raise RuntimeError("no weight group: the driver joins it first (`rl_roles.PoolSync`)")
        return self.weights

    @register(Dispatch.ONE_TO_ALL)
    def leave_weights(self) -> None:
        """Leave the weight group (at the end of the run, or before joining a new one)."""
        if self.weights is not None:
            self.weights[0].close()
            self.weights = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _drain(named: Any) -> None:
    """Take part in every gather of `named` (fsdp2), keeping nothing."""
    for _ in named:
        pass
