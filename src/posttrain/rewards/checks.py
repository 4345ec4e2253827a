"""A run whose reward cannot be computed must not look like a run that learned nothing.

Two checks, so that a reward function that fails on every call never yields a "successful"
run of reward 0 and gradient 0:

- before the run, `check_reward_signature`: the function can be called the way the runner
  calls it, `fn(prompts=..., completions=..., completion_ids=..., **columns)`, with the
  training data's columns, and every column it needs is there (its parameters without a
  default, and the columns it names in a `required_columns` attribute, as `task_reward`
  does for `task`);
- during the run, `RewardFailureGuard`: the first step's rollout is the check call (a
  function that fails on every sample of it stops the run before any update, with its
  first traceback), and after that `max_bad_steps` steps in a row on which it failed on
  every sample stop it the same way. A function that fails on some samples only keeps
  giving those samples the failure reward, as the runner documents.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.config.core import RunStopped
from posttrain.rewards.runner import RUN_KWARGS, RewardRunner, run_kwargs_of

__all__ = ["RewardFailureGuard", "RewardFunctionError", "check_reward_signature"]

ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What the runner passes to every reward function, besides the data's columns."""


class RewardFunctionError(RunStopped):
    """A reward function failed on every sample: the run cannot learn from it."""


def check_reward_signature(name: str, fn: Callable[..., Any], columns: Sequence[str], data: str) -> None:
    """Raise ValueError when `fn` cannot take the runner's arguments and `data`'s `columns`,
    or needs a column `data` lacks; the message names the function and what is wrong."""
    have = ", ".join(columns) or "none"
    needed: Mapping[str, str] = getattr(fn, "required_columns", {})
    for column, hint in needed.items():
        if column not in columns:
            raise ValueError(f"reward function {name!r} needs the column {column!r}, which {data} does not "
                             f"have (its columns: {have}); {hint}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: nothing more to check
        return
    given = [*ARGUMENTS, *columns]
    missing = [p.name for p in signature.parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
               and p.name not in given and p.name not in RUN_KWARGS]
    given += run_kwargs_of(fn)
    if missing:
        raise ValueError(f"reward function {name!r}{signature} needs the column {missing[0]!r}, which {data} does "
                         f"not have (its columns: {have}); add it to the data, or give the parameter a default")
    try:
        signature.bind(**dict.fromkeys(given))
    except TypeError as e:
        raise ValueError(
            f"reward function {name!r}{signature} cannot be called as fn(prompts=..., completions=..., "
            f"completion_ids=..., **columns) with the columns of {data} ({have}): {e}; a reward function "
            "takes these by keyword: accept prompts, completions, completion_ids and **kwargs (or name "
            "every column)") from None


class RewardFailureGuard:
    """Stops the run when a reward function failed on every sample of a step: on the first
    step it checks, or on `max_bad_steps` steps in a row (`trainer.max_bad_steps`, which
    bounds NaN losses the same way). A step on which the function scored any sample resets
    its count."""

    def __init__(self, runner: RewardRunner, max_bad_steps: int):
        if max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be >= 1, got {max_bad_steps}")
        self.runner, self.max_bad_steps = runner, max_bad_steps
        self.consecutive = dict.fromkeys(runner.names, 0)
        self.checked = False

    def update(self, step: int, errors: Mapping[str, float], samples: int) -> None:
        """Record one step: `errors[name]` of its `samples` scored samples failed. Raises
        `RewardFunctionError` at the limit."""
        first, self.checked = not self.checked, True
        for name in self.runner.names:
            failed_all = samples > 0 and errors.get(name, 0) >= samples
            self.consecutive[name] = self.consecutive[name] + 1 if failed_all else 0
            if failed_all and (first or self.consecutive[name] >= self.max_bad_steps):
                raise RewardFunctionError(self._message(name, step, samples, first))

    def _message(self, name: str, step: int, samples: int, first: bool) -> str:
        if first:
            when = (f"on all {samples} samples of step {step}, the first of this run, so the run stops "
                    "before any update")
        else:
            when = (f"on every sample of {self.consecutive[name]} steps in a row (trainer.max_bad_steps="
                    f"{self.max_bad_steps}), up to step {step}")
        first_failure = self.runner.first_failure(name) or "(not recorded)"
        return (f"reward function {name!r} failed {when}: it gives no learning signal; fix it, or take it "
                f"out of reward.functions. Over the run, {self.runner.tallies[name].describe(name)}. "
                f"Its first failure: {first_failure}")
