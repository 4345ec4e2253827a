"""Resource pools (veRL's `ResourcePoolManager`): a worker group per pool, by pool name.

    pools = start_ray_pools({"global_pool": (spec, factory, args), "critic_pool": (...)})
    pools["critic_pool"].dp_compute("critic_values", batch)
    pools.close()

`start_ray_pools` joins or starts Ray once, places every pool's placement group in one
`ray_session.place` (a cluster too small for the sum of the pools' bundles fails in
seconds, naming every pool's keys, before any worker starts), then starts the groups'
workers together and waits for all of them. Each group is its own gloo group (its ranks
0..W-1): pools share no collective. This layer knows no role: which roles a pool's workers
hold is in the factory arguments (`trainers/rl_worker.py`).
"""

from __future__ import annotations

import atexit
from typing import Any

from posttrain.distributed.groups import Factory, GroupSpec, RayWorkerGroup


class WorkerPools:
    """The run's worker groups by pool name; `close()` closes each, then a Ray `session`
    started for them (idempotent; it also runs at interpreter exit)."""

    def __init__(self, groups: dict[str, Any], session: Any = None):
        self.groups, self.session = dict(groups), session
        atexit.register(self.close)

    def __getitem__(self, name: str) -> Any:
        return self.groups[name]

    def restart(self) -> None:
        """New workers for every pool (`RayWorkerGroup.restart`): after a worker death the run
        resumes from its last checkpoint, which every pool's roles must load again."""
        for group in self.groups.values():
            group.restart()

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups = {}
        if self.session is not None:
            self.session.close()
        atexit.unregister(self.close)


def start_ray_pools(pools: dict[str, tuple[GroupSpec, Factory, tuple]]) -> WorkerPools:
    """One `RayWorkerGroup` per pool (name → (spec, factory, args)); every spec has the same
    Ray address and num_cpus. A failure (placement, a worker's setup) closes what started and re-raises."""
    from posttrain.distributed.ray_session import RaySession, place

    specs = [spec for spec, _, _ in pools.values()]
    session = RaySession(specs[0].address, specs[0].num_cpus)
    groups: dict[str, RayWorkerGroup] = {}
    placements: list[Any] = []
    try:
        placements = place(session.ray, [s.bundles() for s in specs], max(s.placement_timeout_s for s in specs))
        for name, (spec, factory, args) in pools.items():
            groups[name] = RayWorkerGroup(spec, factory, *args, placement=placements.pop(0), ready=False)
        for group in groups.values():
            group.wait_ready()
    except BaseException:
        from ray.util.placement_group import remove_placement_group

        for g in placements:  # made but not yet handed to a group
            remove_placement_group(g)
        WorkerPools(groups, session).close()
        raise
    return WorkerPools(groups, session)
