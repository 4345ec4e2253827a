"""An interactive built-in environment whose feedback the model must use: guess the number.

    row:          {"prompt": "Guess my number.", "secret": 37, "low": 1, "high": 100}
    model:        <call>guess(50)</call>
    environment:  <result>lower</result>
    model:        <call>guess(25)</call>
    environment:  <result>higher</result>
    ...
    model:        <call>guess(37)</call>            -> done, reward 1/k at the k-th model turn

The plain-text protocol (`text_protocol.py`, stop string `</call>`); only a turn's first
call is read. A wrong guess earns 0, the right one 1/k (fewer turns earn more), a turn
without a call ends the episode with 0. A call that is not `guess(INTEGER)` in range is
answered with an error result and counted in `tool_errors`.
"""

from __future__ import annotations

from typing import Any

from posttrain.envs.base import StepResult
from posttrain.envs.text_protocol import MalformedCall, TextProtocol, format_results, parse_calls


class GuessNumber:
    """Higher / lower feedback on guesses of `row["secret"]` (module docstring)."""

    protocol = TextProtocol()
    columns = ("secret",)
    """The data columns `reset` reads (`registry.check_environment_columns`); low and high
    are optional (1 and 100)."""

    def reset(self, row: dict[str, Any]) -> str:
        self.secret, self.low, self.high = int(row["secret"]), int(row.get("low", 1)), int(row.get("high", 100))
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} is outside [{self.low}, {self.high}]")
        self.turns = 0
        return f" Guess a number from {self.low} to {self.high}: <call>guess(N)</call>."

    def step(self, action: str) -> StepResult:
        self.turns += 1
        calls = parse_calls(action)
        if not calls:
            return StepResult("", reward=0.0, done=True, info={"tool_calls": 0})
        guess = self._guess(calls[0])
        if isinstance(guess, str):
            return StepResult(format_results([guess]), 0.0, False, {"tool_calls": 1, "tool_errors": 1})
        if guess == self.secret:
            return StepResult("", reward=1.0 / self.turns, done=True, info={"tool_calls": 1})
        answer = "higher" if self.secret > guess else "lower"
        return StepResult(format_results([answer]), 0.0, False, {"tool_calls": 1})

    def _guess(self, call) -> int | str:
        """The guessed integer, or the error text shown to the model."""
        if isinstance(call, MalformedCall):
            return call.message
        if call.name != "guess":
            return f"error: unknown tool {call.name!r}; tools: guess"
        try:
            value = int(str(call.arguments).strip())
        except ValueError:
            return f"error: guess takes an integer, got {call.arguments!r}"
        if not self.low <= value <= self.high:
            return f"error: guess from {self.low} to {self.high}"
        return value
