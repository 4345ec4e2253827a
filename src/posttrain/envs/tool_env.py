"""ToolEnvironment: an environment whose actions are tool calls (TRL's `tools=` and
`environment_factory`).

    env = ToolEnvironment(tools=[calculator])          # plain functions
    class Shop(ToolEnvironment):                       # or public methods of a subclass
        def price(self, item: str) -> str:
            \"\"\"Price of an item.

            Args:
                item: The item's name.
            \"\"\"
            return PRICES[item]

One step: the model's turn is parsed for calls (`protocol.parse_calls`); no call means
the turn is the final answer: done, with reward `score(answer)` (None unless a subclass
says otherwise). Otherwise at most `max_calls_per_turn` calls run concurrently, each under
`timeout_s` (`tools.run_calls`); the observation holds one result per call, an error
text for a call that failed, and the step's info counts `tool_calls`, `tool_errors`
(malformed, unknown, bad arguments, raised, timed out) and `tool_timeouts`, and `calls`
lists each call with its result (`call_record`, what samples.jsonl shows).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.envs.base import StepResult
from posttrain.envs.text_protocol import MalformedCall, TextProtocol
from posttrain.envs.tools import Tool, ToolCall, ToolOutcome, as_tool, run_calls, tools_by_name


class ToolEnvironment:
    """Tools, a call protocol and the episode's row (module docstring).

    Args:
        tools: functions (or `Tool`s); a subclass's public methods are added.
        protocol: how calls are written and results shown: `TextProtocol()` (default,
            the plain-text protocol) or `chat.ChatProtocol(tokenizer)`.
        timeout_s: wall-clock limit of each call.
        max_calls_per_turn: calls read per turn; the ones after them are answered with an error.
        describe_tools: append the protocol's tool description to the prompt at reset.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | Tool] = (),
        protocol=None,
        timeout_s: float = 10.0,
        max_calls_per_turn: int = 8,
        describe_tools: bool = True,
    ):
        self.tools = tools_by_name([*tools, *self._method_tools()])
        self.protocol = protocol if protocol is not None else TextProtocol()
        self.timeout_s, self.max_calls_per_turn = timeout_s, max_calls_per_turn
        self.describe_tools = describe_tools
        self.row: dict[str, Any] = {}

    @property
    def schemas(self) -> list[dict]:
        """The tools' JSON schemas (what `apply_chat_template(tools=...)` takes)."""
        return [t.schema for t in self.tools.values()]

    def reset(self, row: dict[str, Any]) -> str | None:
        self.row = dict(row)
        return self.protocol.describe(self.schemas) if self.describe_tools else None

    def step(self, action: str) -> StepResult:
        calls = self.protocol.parse_calls(action)
        if not calls:
            return StepResult("", reward=self.score(action), done=True, info={"tool_calls": 0})
        outcomes: list[ToolOutcome | None] = [None] * len(calls)
        runnable: list[tuple[int, ToolCall]] = []
        for i, call in enumerate(calls):
            if isinstance(call, MalformedCall):
                outcomes[i] = ToolOutcome(call.message, error=True)
            elif i >= self.max_calls_per_turn:
                outcomes[i] = ToolOutcome(f"error: more than {self.max_calls_per_turn} calls in one turn", True)
            else:
                runnable.append((i, call))
        ran = run_calls([c for _, c in runnable], self.tools, self.timeout_s)
        for (i, _), outcome in zip(runnable, ran):
            outcomes[i] = outcome
        names = [getattr(c, "name", "") for c in calls]
        observation = self.protocol.format_results([(n, o.text) for n, o in zip(names, outcomes)])
        info = {
            "tool_calls": len(calls),
            "tool_errors": sum(o.error for o in outcomes),
            "tool_timeouts": sum(o.timed_out for o in outcomes),
            "calls": [call_record(c, o) for c, o in zip(calls, outcomes)],
        }
        return StepResult(observation, reward=None, done=False, info=info)

    def score(self, answer: str) -> float | None:
        """The reward of the final answer (a turn without a call); None = no environment reward."""
        return None

    def _method_tools(self) -> list[Tool]:
        """Public methods a subclass defines (TRL: an environment's methods are its tools)."""
        own = set(dir(ToolEnvironment))
        methods = [getattr(self, name) for name in dir(type(self)) if not name.startswith("_") and name not in own]
        return [as_tool(m) for m in methods if inspect.ismethod(m)]



def call_record(call: ToolCall | MalformedCall, outcome: ToolOutcome) -> dict[str, Any]:
    """One call of a step as the run's samples show it: {name, arguments, result, error}
    (a malformed call: name None, arguments its raw text)."""
    if isinstance(call, MalformedCall):
        return {"name": None, "arguments": call.text, "result": outcome.text, "error": True}
    return {"name": call.name, "arguments": call.arguments, "result": outcome.text, "error": outcome.error}
