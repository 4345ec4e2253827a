"""Where an RL run's roles run on trainer.backend=ray: the resource pools (veRL's
resource_pool_spec), the Ray cluster, and the keys only Ray reads (`RLConfig` holds them
as `placement` and `ray`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.config.aliases import aliases, verl
from posttrain.config.core import check


@dataclass
class PoolConfig:
    """A resource pool of a role's own (trainer.backend=ray), in the words of veRL's
    `reward_model.enable_resource_pool` / `nnodes` / `n_gpus_per_node`."""

    enable_resource_pool: bool = False
    """true: the role runs on workers of its own, one placement group of its own; false: on
    the actor's workers (global_pool), colocated with it in one process per worker."""
    nnodes: int = 1
    """Nodes this pool's workers span."""
    n_workers_per_node: int = 1
    """Workers per node in this pool (on a CPU, processes of cpus_per_worker threads)."""
    cpus_per_worker: int | None = None
    """CPU cores reserved for each of this pool's workers, and its torch threads (null:
    placement.cpus_per_worker)."""


GLOBAL_POOL = "global_pool"
"""The actor's pool (veRL's name): trainer.nnodes × trainer.n_workers_per_node workers."""


@dataclass(frozen=True)
class ResourcePool:
    """One pool of `RLConfig.resource_pools`: veRL's resource_pool_spec entry
    [n_workers_per_node] × nnodes, each worker's CPUs, and the config keys that set them."""

    nnodes: int
    n_workers_per_node: int
    cpus_per_worker: int
    section: str
    """Where nnodes and n_workers_per_node are set: `trainer` or `placement.<role>`."""
    cpus_key: str
    """The key cpus_per_worker comes from."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_workers_per_node


@dataclass
class PlacementConfig:
    """Where the roles run (trainer.backend=ray): resource pools, one placement-group bundle
    {"CPU": cpus_per_worker} per worker. By default every role shares global_pool: actor,
    reference, rollout and critic in one process per worker (veRL's hybrid engine). The
    critic and the rollout may each get a pool of their own; the reference always stays
    with the actor (it reads the actor's batches and, with LoRA, the actor's own model)."""

    cpus_per_worker: int = 1
    """CPU cores reserved for each worker, and its torch threads."""
    gpus_per_worker: float = 0.0
    """GPUs reserved for each worker (veRL: a worker is a GPU). 0: CPU workers. 1: a GPU of its
    own, the workers joined over NCCL. A fraction (0.5: two workers per GPU, e.g. 2 workers on
    a 1-GPU machine): workers share a GPU, joined over gloo (NCCL refuses two ranks on one
    device). The roles' models stay on the device model.device gives them (cuda for a GPU run)."""

    critic: PoolConfig = field(default_factory=PoolConfig)
    """The critic's pool (PPO): with enable_resource_pool=true the value model and its AdamW
    live on workers of their own, one data-parallel gloo group (critic_pool)."""
    rollout: PoolConfig = field(default_factory=PoolConfig)
    """The rollout's pool: with enable_resource_pool=true the generation engines live on
    workers of their own (rollout_pool), each over a copy of the policy that takes the
    actor's weights after every update: streamed from actor worker 0 over a gloo (NCCL with
    whole GPUs) group of their own, in buckets of rollout.sync_bucket_mb; under
    trainer.strategy=fsdp2 every actor worker gathers one parameter at a time for it."""

    def validate(self) -> None:
        check(self.cpus_per_worker >= 1, "placement.cpus_per_worker", f"must be >= 1, got {self.cpus_per_worker}")
        check(self.gpus_per_worker >= 0, "placement.gpus_per_worker", f"must be >= 0, got {self.gpus_per_worker}")
        for role in ("critic", "rollout"):
            p, key = getattr(self, role), f"placement.{role}"
            check(p.nnodes >= 1, f"{key}.nnodes", f"must be >= 1, got {p.nnodes}")
            check(p.n_workers_per_node >= 1, f"{key}.n_workers_per_node", f"must be >= 1, got {p.n_workers_per_node}")
            check(p.cpus_per_worker is None or p.cpus_per_worker >= 1, f"{key}.cpus_per_worker",
                  f"must be >= 1 or null (placement.cpus_per_worker), got {p.cpus_per_worker}")

    def own_pools(self) -> list[str]:
        """The roles with a pool of their own (critic, rollout)."""
        return [role for role in ("critic", "rollout") if getattr(self, role).enable_resource_pool]


@dataclass
class RayConfig:
    """The Ray cluster (trainer.backend=ray)."""

    address: str | None = None
    """null: start Ray in this process, bound to 127.0.0.1, and stop it at the end of the run;
    `auto`: join the cluster `ray start --head` / `ray start --address=HEAD:6379` made on this
    machine's nodes; or a cluster address (HOST:PORT, ray://HOST:10001)."""
    num_cpus: int | None = field(default=None, metadata=aliases(verl("ray_init.num_cpus")))
    """CPUs the Ray this run starts declares (null: this machine's cores). More than the machine has lets more workers × placement.cpus_per_worker be placed
    than there are cores (they then share them). Only with ray.address=null: a cluster joined
    at an address declares its own (`ray start --num-cpus=N` on each node)."""

    def validate(self) -> None:
        check(self.num_cpus is None or self.num_cpus >= 1, "ray.num_cpus", f"must be >= 1 or null, got {self.num_cpus}")
        check(self.num_cpus is None or self.address is None, "ray.num_cpus",
              f"declares the CPUs of a Ray this run starts, but ray.address={self.address} joins a cluster, "
              "whose nodes declare their own (ray start --num-cpus=N): drop ray.num_cpus or ray.address")


@dataclass
class FSDPConfig:
    """FSDP2's memory levers in the RL workers (trainer.strategy=fsdp2; veRL's
    `actor_rollout_ref.actor.fsdp_config`). Both need CUDA workers."""

    param_offload: bool = field(default=False, metadata=aliases(verl("actor_rollout_ref.actor.fsdp_config.param_offload")))
    """Keep each worker's parameter and gradient shards on the CPU (`CPUOffloadPolicy`): each
    layer is copied to the GPU for its forward and backward, and AdamW steps on the CPU."""
    optimizer_offload: bool = field(default=False, metadata=aliases(
        verl("actor_rollout_ref.actor.fsdp_config.optimizer_offload")))
    """Keep AdamW's moments on the CPU between optimizer steps (moved to the GPU for each step)."""

    def check(self, strategy: str, cuda: bool) -> None:
        """Offload needs sharded models (trainer.strategy=fsdp2) on CUDA workers."""
        for key in ("param_offload", "optimizer_offload"):
            if not getattr(self, key):
                continue
            check(strategy == "fsdp2", f"trainer.fsdp.{key}", f"offloads FSDP2 shards: set trainer.strategy=fsdp2 "
                  f"(got {strategy}), or drop trainer.fsdp.{key}")
            check(cuda, f"trainer.fsdp.{key}", "moves GPU memory to the CPU, and these workers have no GPU (CUDA "
                  "unavailable, model.device=cpu or placement.gpus_per_worker=0): drop it, or run on CUDA workers")


RAY_ONLY = ("trainer.nnodes", "trainer.n_workers_per_node", "trainer.collective_timeout_s",
            "trainer.on_worker_failure", "trainer.max_restarts", "placement", "ray")
"""The keys and sections only trainer.backend=ray reads: set on the local backend, they are refused."""
