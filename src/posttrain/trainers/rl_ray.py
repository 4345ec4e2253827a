"""The RL workers on Ray (trainer.backend=ray): veRL's hybrid engine and resource pools.

Each Ray worker process holds one `rl_worker.RLWorker`, the class the local backend runs once
in process; the driver calls the same generated views (`rl_roles.Roles`) on both backends.
By default a worker holds every role: its own actor (policy, AdamW, schedule), its reference,
its critic (PPO: a separate value model with its own AdamW) and its rollout engine, the engine
over the actor's policy module, so it reads the actor's weights in place and a weight sync
copies nothing. `RLConfig.resource_pools` may map the critic or the rollout to a pool of its
own (placement.critic / placement.rollout): that pool's workers hold only that role (a critic
pool: its own gloo group; a rollout pool: engines over their own policy copy, which
`Roles.sync_rollout` fills after each update, streamed from the actor's worker 0 in buckets
over a weight group of their own: `rl_roles.PoolSync`). The reference stays with the actor.

The vllm engine (rollout.engine=vllm; GPU workers, placement.gpus_per_worker, with vLLM's CUDA
build, CPU workers with its CPU build): each worker
builds its own `VLLMEngine` over its actor's policy, last (`build_rollout`, after the actor,
reference and critic took their memory), and runs it in the worker's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0). `rollout.offload` puts every engine to sleep (level 1,
where sleep mode exists) before the update; `rollout.sync_weights` wakes each and loads its own
actor's new weights in place (`VLLMEngine.sync_weights`: `collective_rpc`, tensors by
reference in process), then drops its prefix cache: the local engine's path, per worker.

A worker that dies stops the run within seconds (`WorkerFailure`, naming it and the last
complete checkpoint), or with trainer.on_worker_failure=restart starts new workers and
resumes from that checkpoint (`rl_faults.run_restarting`, around the loop).

Not on this backend: a critic on the policy's backbone (critic.share_backbone: the value
head and the policy would train in one loss and one optimizer, a layout the workers' separate
roles do not have; config checks, `RLConfig._validate_ray`). An
environment or tool loaded from a file (`file.py:Class`) reaches the workers by value
(`rewards.registry.pickle_file_modules_by_value`); one given in Python must be importable by
the workers, or defined in the driver's script (cloudpickle sends `__main__`'s by value).
"""

from __future__ import annotations

from posttrain.config.placement import ResourcePool
from posttrain.config.rl import RLConfig
from posttrain.distributed.groups import GroupSpec
from posttrain.distributed.pools import WorkerPools, start_ray_pools
from posttrain.trainers.rl_worker import RLWorker


def start_worker_pools(cfg: RLConfig, specs: dict[str, ResourcePool], mapping: dict[str, str],
                       args: dict[str, tuple]) -> WorkerPools:
    """Start the Ray workers of every resource pool (`RLConfig.resource_pools`), each building
    an `RLWorker` from its pool's arguments (`rl_worker.pool_factories`)."""
    from posttrain.distributed.ray_session import import_ray
    from posttrain.rewards.registry import pickle_file_modules_by_value

    t = cfg.trainer
    pickle_file_modules_by_value(import_ray().cloudpickle)  # before the arguments are pickled
    return start_ray_pools({name: (GroupSpec(
        p.nnodes, p.n_workers_per_node, p.cpus_per_worker, cfg.ray.address, cfg.ray.num_cpus,
        t.collective_timeout_s,
        gpus_per_worker=cfg.placement.gpus_per_worker, roles=pool_label(cfg, mapping, name),
        restartable=t.on_worker_failure == "restart", section=p.section, cpus_key=p.cpus_key),
        RLWorker, args[name]) for name, p in specs.items()})


def pool_label(cfg: RLConfig, mapping: dict[str, str], pool: str) -> str:
    """What a pool's workers hold, for error messages ("actor, rollout, reference")."""
    with_ref = {**mapping, "reference": mapping["actor"]} if cfg.algorithm.kl.enabled else mapping
    return ", ".join(r for r in ("actor", "rollout", "reference", "critic") if with_ref.get(r) == pool)
