"""Starting or joining Ray, and placing workers on it (veRL's resource pool).

Hygiene (measured, `../shared/SCALEOUT.md`): before ray is imported, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
keeps a locally started Ray on 127.0.0.1 (`_node_ip_address` alone does not),
RAY_USAGE_STATS_ENABLED=0 and RAY_AUTH_MODE=disabled keep it quiet; Ray's socket paths must
stay under 107 bytes, so a local session lives in a short `mkdtemp` under /tmp, removed at
`close`. A placement group that cannot be satisfied waits silently, so `place` checks the
cluster's CPUs first and then waits for the group a bounded time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from posttrain.config import ConfigError

QUIET_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def import_ray() -> Any:
    """`ray`, imported after QUIET_ENV is in the environment (an explicit setting wins)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError:
        raise ConfigError("trainer.backend: ray needs Ray installed: pip install 'posttrain[ray]'") from None
    return ray


class RaySession:
    """This process's connection to Ray: joined if already initialised (a test's session),
    else started (address None: a local Ray on 127.0.0.1 with this machine's cores) or joined
    (`auto`, HOST:PORT). `close` shuts down only what this object started."""

    def __init__(self, address: str | None):
        ray = self.ray = import_ray()
        self.started, self.temp_dir = False, None
        if ray.is_initialized():
            return
        if address is None:
            # the pid names the process that started it (a test finds its own raylet by it)
            self.temp_dir = tempfile.mkdtemp(prefix=f"ptray-{os.getpid()}-", dir="/tmp" if os.path.isdir("/tmp") else None)
            ray.init(address="local", num_cpus=os.cpu_count() or 1, _node_ip_address="127.0.0.1",
                     include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                     _temp_dir=self.temp_dir)
        else:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        self.started = True

    @property
    def loopback(self) -> bool:
        return self.temp_dir is not None

    def close(self) -> None:
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        self.started = False
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def cluster_cpus(ray: Any) -> tuple[float, float, int]:
    """(CPUs in the cluster, CPUs free now, live nodes)."""
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0), nodes


def bundle(cpus: int, gpus: float) -> dict[str, float]:
    """One worker's placement-group bundle: {"CPU": cpus}, plus {"GPU": gpus} on GPU workers."""
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


def place(ray: Any, workers: int, cpus_per_worker: int, shape: str, timeout_s: float,
          gpus_per_worker: float = 0.0) -> Any:
    """One placement group of `workers` bundles (`bundle`: CPUs, and GPUs on GPU workers; PACK:
    as few nodes as fit), ready within `timeout_s`, or a ConfigError naming the config keys
    (`shape` says how `workers` was computed) and what the cluster has."""
    from ray.util.placement_group import placement_group, remove_placement_group

    need = workers * cpus_per_worker
    total, free, nodes = cluster_cpus(ray)
    advice = ("lower trainer.n_workers_per_node or placement.cpus_per_worker, or add nodes to the "
              "cluster (ray start --address=HEAD:6379, then ray.address=auto)")
    if need > total:
        raise ConfigError(f"trainer.n_workers_per_node: {shape} = {need} CPUs, but the Ray cluster has "
                          f"{total:g} CPUs on {nodes} node(s) ({free:g} free); {advice}")
    gpus = ray.cluster_resources().get("GPU", 0.0)
    if workers * gpus_per_worker > gpus:
        raise ConfigError(f"placement.gpus_per_worker: {gpus_per_worker:g} GPUs × {workers} workers = "
                          f"{workers * gpus_per_worker:g} GPUs, but the Ray cluster has {gpus:g}; lower "
                          "placement.gpus_per_worker (0.5: two workers per GPU) or trainer.n_workers_per_node")
    group = placement_group([bundle(cpus_per_worker, gpus_per_worker)] * workers, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        total, free, nodes = cluster_cpus(ray)
        raise ConfigError(f"trainer.n_workers_per_node: {workers} workers of placement.cpus_per_worker="
                          f"{cpus_per_worker} CPUs could not be placed within {timeout_s:g} s; the Ray cluster "
                          f"has {total:g} CPUs on {nodes} node(s), {free:g} free (another job holds them, or no "
                          f"node has {cpus_per_worker} free); {advice}") from None
    return group
