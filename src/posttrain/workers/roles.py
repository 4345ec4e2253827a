"""The roles as the RL driver calls them: typed interfaces, whatever runs them.

The driver (`trainers/rl.py`) never holds a role object: it calls these methods on views
generated from the worker class's declarations (`trainers/rl_worker.py`,
`distributed.register`), over a group of one in-process worker (trainer.backend=local) or of
N Ray workers. Each method's dispatch mode is declared on the worker; the shapes here are
those of the whole batch (B rows, Tr response tokens).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from posttrain.rollout import MultiTurnLimits, SamplingParams
from posttrain.workers.batch import RLBatch


class ActorRole(Protocol):
    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr) log-probs of the current policy."""

    def update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, kl_coef: float,
               seed: int) -> dict[str, float]:
        """`epochs` passes of shuffled mini-batches, one optimizer step each (`Actor.update`)."""

    def lr(self) -> float:
        """The learning rate the next update uses."""

    def model(self) -> nn.Module:
        """Worker 0's policy (in process: the worker's own module; Ray: a copy)."""


class CriticRole(Protocol):
    def compute_values(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr) V(s_t)."""

    def update(self, batch: RLBatch, mini_batch_rows: int, epochs: int, seed: int) -> dict[str, float]:
        """`Critic.update` (nothing for a critic on the policy's backbone)."""

    def model(self) -> nn.Module:
        """Worker 0's value model."""


class ReferenceRole(Protocol):
    shares_policy: bool
    """A LoRA run's reference: the policy with its adapter disabled (it cannot be synced)."""

    def compute_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """(B, Tr) log-probs of π_ref."""

    def sync(self, alpha: float) -> None:
        """TR-DPO: ref ← α·policy + (1 − α)·ref on every worker, from its own actor."""

    def saved_model(self) -> nn.Module | None:
        """The module a checkpoint holds (None until synced: rebuilt from the initial policy)."""


class RolloutRole(Protocol):
    kind: str
    """The engine every worker runs (native, hf, vllm)."""
    params: SamplingParams
    env_factory: Any
    limits: MultiTurnLimits

    def generate(self, prompts: RLBatch, seed: int, params: SamplingParams | None = None) -> RLBatch:
        """n responses per prompt (rows of a group contiguous)."""

    def offload(self) -> None:
        """Every engine gives its memory to the update (vllm sleeps)."""

    def close(self) -> None:
        """At the end of the run: every engine lets go of what it holds outside its process."""
