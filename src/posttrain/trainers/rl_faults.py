"""What a Ray run does when a worker dies (trainer.on_worker_failure, trainer.max_restarts).

A dispatched call fails within seconds of a worker's death (`distributed.groups.WorkerDied`,
the group's workers killed). `run_restarting` wraps the training loop: with `restart`, new
workers for every pool (`restart_workers`) and the loop's own resume from the run's newest
complete checkpoint (`restart_config`); otherwise, or once the restarts are spent,
`WorkerFailure` names the dead worker and the checkpoint to resume from (`failure_message`).
The driver (`trainers/rl.py`) calls `run_restarting` around its loop on every backend (an
in-process worker never dies alone: its exceptions are the driver's).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.checkpoint import find_latest_checkpoint
from posttrain.config import RunStopped
from posttrain.config.rl import RLConfig
from posttrain.distributed.groups import WorkerDied
from posttrain.logging import get_logger
from posttrain.trainers.rl_roles import Roles

log = get_logger(__name__)

class WorkerFailure(RunStopped):
    """A Ray run stopped because a worker died (trainer.on_worker_failure=stop, or its
    trainer.max_restarts were spent); the workers are gone, the last complete checkpoint kept
    (the CLI prints it as `posttrain grpo: stopped: ...` and exits 1)."""


def restart_workers(roles: Roles) -> None:
    """New workers, built from the run's initial weights as at its start (a restore then
    loads a checkpoint into them); the driver's views call the new ones, and a rollout pool's
    weight group is joined again at the next sync."""
    roles.pools.restart()
    if roles.pool_sync is not None:
        roles.pool_sync.joined = False


def run_restarting(trainer: Any, run_once: Callable[[RLConfig], Any]) -> Any:
    """`run_once(config)` (the loop), again after a worker death while
    trainer.on_worker_failure=restart allows: the driver's state back to the start
    (`trainer.load_state`), new workers (`restart_workers`), then the loop's own resume from the
    newest complete checkpoint of the run directory (`restart_config`). Otherwise, and once
    trainer.max_restarts are spent, `WorkerFailure` names the dead worker and the checkpoint
    to resume from."""
    cfg, t = trainer.args, trainer.args.trainer
    initial = copy.deepcopy(trainer.state())
    restarting = t.on_worker_failure == "restart"
    trainer.worker_restarts = 0 if restarting else None
    config, restart = cfg, False
    while True:
        try:
            if restart:  # a worker dying while the new ones start counts as another death
                # the driver's state first: async RL's lane runs out the jobs queued for the dead
                # workers (each fails at once, `RayWorkerGroup.dead`) before new workers start
                trainer.load_state(copy.deepcopy(initial))
                restart_workers(trainer.roles)
            return run_once(config)
        except WorkerDied as died:
            step = trainer.at_step
            last = find_latest_checkpoint(t.output_dir)
            done = trainer.worker_restarts or 0
            if not restarting or done >= t.max_restarts:
                raise WorkerFailure(failure_message(died, step, last, t, done)) from died
            trainer.worker_restarts = done + 1
            where = f"from {last}" if last is not None else "from the start (no complete checkpoint yet)"
            log.warning("at step %s, %s. trainer.on_worker_failure=restart: restart %d of %d, new workers, resuming %s",
                        step, str(died).rstrip("."), done + 1, t.max_restarts, where)
            config, restart = restart_config(cfg, last), True


def restart_config(cfg: RLConfig, last: Path | None) -> RLConfig:
    """The config of a restart: resume from `last`, this run's newest complete checkpoint; with
    none, start as the run did (trainer.resume as set), replacing the outputs the failed
    attempt wrote (config.yaml, metrics.jsonl: this run's own)."""
    t = cfg.trainer
    trainer = (dataclasses.replace(t, resume=str(last)) if last is not None
               else dataclasses.replace(t, overwrite=t.overwrite or t.resume != "auto"))
    return dataclasses.replace(cfg, trainer=trainer)


def failure_message(died: WorkerDied, step: int | None, last: Path | None, t: Any, restarts: int) -> str:
    """What died, where the run stands, and what to do."""
    at = f" at step {step}," if step else ""
    spent = f" after {restarts} restart{'s' * (restarts != 1)} (trainer.max_restarts={t.max_restarts})" if restarts else ""
    if last is not None:
        rerun = "rerun the same command" if t.resume == "auto" else f"rerun with trainer.resume={last}"
        where = f"The last complete checkpoint is {last}; {rerun} to resume from it"
    else:
        again = "starts over" if t.resume in ("auto", "never") else f"starts again from trainer.resume={t.resume}"
        where = (f"No complete checkpoint was written in {t.output_dir} (trainer.save_steps={t.save_steps}); a rerun "
                 f"{again}")
    advice = ("set trainer.on_worker_failure=restart to have the run start new workers and go on by itself"
              if t.on_worker_failure == "stop" else "raise trainer.max_restarts to let it restart more often")
    return (f"trainer.backend=ray:{at} {str(died).rstrip('.')}. The run stopped{spent} and its workers were killed. {where}, or "
            f"{advice}. A worker killed for memory (out of memory, the OOM killer) needs a smaller "
            "actor.micro_batch_size or rollout.max_batch_size, or more memory per worker.")
