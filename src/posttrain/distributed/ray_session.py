"""Starting or joining Ray, and placing workers on it (veRL's resource pool).

Loopback only, whatever the import order: `ray.init(_node_ip_address="127.0.0.1")` alone does
not keep a local Ray on loopback. `ray.init` replaces a loopback address with this machine's
network address (`services.resolve_ip_for_localhost`) unless Ray's `ENABLE_RAY_CLUSTER` is off,
and Ray reads that switch from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is first
imported. A program that imported ray before posttrain set it got a node on the network
address, and with it the GCS, the raylet, the agents and every worker listening on all
interfaces (`*:port`, measured with psutil). So `loopback_only` turns the switch off for the
`ray.init` that starts a local Ray (in Ray's constants module, for the driver, and in the
environment its processes inherit) and puts both back after. Quiet (`QUIET_ENV`, set before
ray is imported when posttrain imports it): RAY_USAGE_STATS_ENABLED=0, RAY_AUTH_MODE=disabled.
Ray's socket paths must stay under 107 bytes, so a local session lives in a short `mkdtemp`
under /tmp, removed at `close`. A driver killed before `close` (SIGKILL, the OOM killer) leaves
that folder and its Ray processes behind: a watchdog (`ray_reaper`) started with the session reaps
them within a second, and a session starting a local Ray first reaps the folders of dead runs.

A placement group that cannot be satisfied waits silently, so `place` checks the cluster's
CPUs first (over every pool: the sum of their bundles) and then waits for the groups a
bounded time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config import ConfigError
from posttrain.distributed import ray_reaper

log = logging.getLogger(__name__)

QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray() -> Any:
    """`ray`, imported after QUIET_ENV is in the environment (an explicit setting wins)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError:
        raise ConfigError("trainer.backend: ray needs Ray installed: pip install 'posttrain[ray]'") from None
    return ray


@contextlib.contextmanager
def loopback_only(ray: Any) -> Iterator[None]:
    """Ray's switch for a node on 127.0.0.1 off for the `ray.init` inside, whenever ray was
    imported: `ray._private.ray_constants.ENABLE_RAY_CLUSTER` (read by the driver's
    `ray.init`) and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (read by the processes it starts). Both
    are put back after, so a later `ray.init(address=...)` of this process is as before."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(LOOPBACK_SWITCH)
    ray_constants.ENABLE_RAY_CLUSTER, os.environ[LOOPBACK_SWITCH] = False, "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before[0]
        if before[1] is None:
            os.environ.pop(LOOPBACK_SWITCH, None)
        else:
            os.environ[LOOPBACK_SWITCH] = before[1]


def joined_address(ray: Any) -> str:
    """The GCS address (HOST:PORT) of the Ray cluster this process is connected to."""
    return ray.get_runtime_context().gcs_address


class RaySession:
    """This process's connection to Ray: joined if already initialised (a test's session),
    else started (address None: a local Ray on 127.0.0.1 with this machine's cores) or joined
    (`auto`, HOST:PORT). `close` shuts down only what this object started. `num_cpus`
    (ray.num_cpus): the CPUs a locally started Ray declares (None: this machine's cores); a
    Ray already initialised must have declared as many. A local Ray comes with a watchdog that
    reaps it if this process dies before `close`."""

    def __init__(self, address: str | None, num_cpus: int | None = None):
        ray = self.ray = import_ray()
        self.started, self.temp_dir, self.watchdog = False, None, None
        if ray.is_initialized():
            cpus = ray.cluster_resources().get("CPU", 0.0)
            if num_cpus is not None and cpus != num_cpus:
                raise ConfigError(f"ray.num_cpus: {num_cpus} CPUs asked, but this process already joined a Ray "
                                  f"of {cpus:g} CPUs (ray.init was called before the run); drop ray.num_cpus, "
                                  "or give num_cpus to that ray.init")
            return
        if address is None:
            self.start_local(num_cpus)
        else:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
            # `auto` joins whichever cluster RAY_ADDRESS or /tmp/ray names: say which one it was
            log.info("ray.address=%s: joined the Ray cluster at %s", address, joined_address(ray))
        self.started = True

    def start_local(self, num_cpus: int | None) -> None:
        """A Ray on 127.0.0.1 in a new `/tmp/ptray-<pid>-*` folder (the pid names the process that
        started it: the reaper tells a dead run's folder by it, a test finds its raylet by it),
        watched from before `ray.init`; the folders of dead runs are reaped first."""
        tmp = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
        if cleaned := ray_reaper.clean_stale(Path(tmp)):
            log.info("ray: %s", cleaned)
        self.temp_dir = tempfile.mkdtemp(prefix=f"{ray_reaper.PREFIX}{os.getpid()}-", dir=tmp)
        self.watchdog = ray_reaper.start_watchdog(Path(self.temp_dir))
        try:
            with loopback_only(self.ray):
                self.ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, _node_ip_address="127.0.0.1",
                              include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                              _temp_dir=self.temp_dir)
        except BaseException:
            ray_reaper.reap([Path(self.temp_dir)])  # whatever the failed ray.init had started
            self.close()
            raise

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
        if self.watchdog is not None:
            self.watchdog.terminate()
            try:
                self.watchdog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.watchdog.kill()
                self.watchdog.wait()
            self.watchdog = None


def cluster_cpus(ray: Any) -> tuple[float, float, int]:
    """(CPUs in the cluster, CPUs free now, live nodes)."""
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0), nodes


def bundle(cpus: int, gpus: float) -> dict[str, float]:
    """One worker's placement-group bundle: {"CPU": cpus}, plus {"GPU": gpus} on GPU workers."""
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


@dataclass(frozen=True)
class Bundles:
    """One pool's placement group: `workers` bundles of `bundle(cpus_per_worker, gpus_per_worker)`."""

    workers: int
    cpus_per_worker: int
    shape: str
    """How `workers` × `cpus_per_worker` was computed, naming the config keys."""
    keys: tuple[str, ...]
    """The config keys that size the pool (an error names them first, and advises lowering them)."""
    gpus_per_worker: float = 0.0
    """placement.gpus_per_worker (0: CPU workers)."""

    @property
    def cpus(self) -> int:
        return self.workers * self.cpus_per_worker


def place(ray: Any, pools: Sequence[Bundles], timeout_s: float) -> list[Any]:
    """One placement group per pool (PACK: as few nodes as fit), all ready within
    `timeout_s`, or a ConfigError naming the pools' config keys, how many CPUs (and GPUs) they
    need together (Σ workers × cpus_per_worker over the pools) and what the cluster has; a
    failure removes every group it made."""
    from ray.util.placement_group import placement_group, remove_placement_group

    keys = list(dict.fromkeys(k for p in pools for k in p.keys))
    need = sum(p.cpus for p in pools)
    shape = " + ".join(p.shape for p in pools)
    total, free, nodes = cluster_cpus(ray)
    advice = (f"lower {' or '.join(keys)}, declare more CPUs than the cores (ray.num_cpus=N, when the run starts "
              "Ray itself), or add nodes to the cluster (ray start --address=HEAD:6379, then ray.address=auto)")
    if need > total:
        raise ConfigError(f"{', '.join(keys)}: {shape} = {need} CPUs, but the Ray cluster at {joined_address(ray)} has "
                          f"{total:g} CPUs on {nodes} node(s) ({free:g} free); {advice}")
    gpus, need_gpus = ray.cluster_resources().get("GPU", 0.0), sum(p.workers * p.gpus_per_worker for p in pools)
    if need_gpus > gpus:
        raise ConfigError(f"placement.gpus_per_worker: the pools need {need_gpus:g} GPUs, but the Ray cluster at {joined_address(ray)} has "
                          f"{gpus:g}; lower placement.gpus_per_worker (0.5: two workers per GPU) or "
                          "trainer.n_workers_per_node")
    groups = [placement_group([bundle(p.cpus_per_worker, p.gpus_per_worker)] * p.workers, strategy="PACK")
              for p in pools]
    try:
        ray.get([g.ready() for g in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for g in groups:
            remove_placement_group(g)
        total, free, nodes = cluster_cpus(ray)
        raise ConfigError(f"{', '.join(keys)}: {shape} = {need} CPUs could not be placed within {timeout_s:g} s; "
                          f"the Ray cluster has {total:g} CPUs on {nodes} node(s), {free:g} free (another job "
                          f"holds them, or no node has a bundle's CPUs free); {advice}") from None
    return groups
