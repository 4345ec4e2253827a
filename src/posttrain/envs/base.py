"""The environment protocol: what an episode talks to between model turns.

    env = MyEnv()
    extra = env.reset(row)                 # row: the dataset row (prompt, answer, ...)
    result = env.step(model_turn_text)     # StepResult(observation, reward, done, info)

An environment is created per episode (one per sampled response, TRL's
`environment_factory`), so it may keep the episode's state on itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    observation: str
    """Text shown to the model next, already in the protocol's format (e.g.
    `<result>1081</result>`); ignored when `done`."""
    reward: float | None = None
    """This step's reward, or None for none. The episode's environment reward is the sum
    of the steps' rewards (a final-only reward is a sum with one term)."""
    done: bool = False
    """The episode is over (the model gave its answer, or the environment ended it)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Facts about the step; `tool_calls`, `tool_errors`, `tool_timeouts` (ints) are
    summed into the rollout metrics."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment."""

    def reset(self, row: dict[str, Any]) -> str | None:
        """Start an episode for dataset `row`; returns text appended to the prompt (tool
        descriptions, a first observation) or None."""
        ...

    def step(self, action: str) -> StepResult:
        """The model's turn `action` (decoded text) -> the environment's answer."""
        ...
