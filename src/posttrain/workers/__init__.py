"""The roles the RL driver calls (veRL's single-controller workers), as local objects.

    rollout.generate(prompts, seed) -> RLBatch        Rollout   (rollout_worker.py)
    reward.score(batch)                               Reward    (reward_worker.py)
    actor.compute_logprobs(batch), actor.update(...)  Actor     (actor.py)
    ref.compute_logprobs(batch)                       Reference (reference.py)
    critic.compute_values(batch), critic.update(...)  Critic    (critic.py)
    rollout.sync_weights(model)                       after each update

Roles take and return `RLBatch` containers (batch.py) and plain numbers, never config
trees other than the run's own config, or each other's internals. The RL driver never holds
them: one worker class (`trainers/rl_worker.py`) holds those of its process, and the driver
calls views typed by `roles.py`, the same whether one in-process worker or N Ray workers run
them (`posttrain.trainers.rl`). Each role
method checks the fields it reads at its entry (`RLBatch.require`), so a stage run out of
order fails there, naming the role, the method and the missing field.
"""

from posttrain.workers.actor import Actor
from posttrain.workers.batch import BatchOps, RLBatch
from posttrain.workers.critic import Critic, head_on_policy
from posttrain.workers.reference import Reference
from posttrain.workers.reward_worker import Reward
from posttrain.workers.rollout_worker import Rollout

__all__ = [
    "Actor",
    "BatchOps",
    "Critic",
    "RLBatch",
    "Reference",
    "Reward",
    "Rollout",
    "head_on_policy",
]
