"""Tools: plain Python functions (or bound methods) the model may call, their schemas, and
running calls concurrently under a timeout, never crashing.

    tool = as_tool(calculator)           # Tool(name, fn, schema)
    tool.schema                          # {"type": "function", "function": {"name", "description", "parameters"}}
    outcomes = run_calls([ToolCall("calculator", "23*47")], {"calculator": tool}, timeout_s=5)
    outcomes[0].text                     # "1081"

Schemas come from the function's type hints and Google-style docstring through
`transformers.utils.get_json_schema` (the format `apply_chat_template(tools=...)` takes,
and TRL's rule for `tools=` / environment methods): every parameter needs a type hint and
an `Args:` line.

Arguments: a call carries either a dict (a chat model's JSON arguments) or a raw string
(the plain-text protocol, `text_protocol.py`). A raw string goes whole to a tool with a
single parameter (`calculator(23*47)`, `python(print(1))`); for any other tool it is read
as Python call arguments made of literals (`lookup("x", k=3)`, via `ast`, never `eval`).
Values are converted to the parameter's annotated int / float / str / bool.

Failures: an unknown tool, arguments that do not bind (missing, extra, wrong literal,
wrong type), a tool that raises, or one still running after `timeout_s` gives an outcome
whose text is `error: ...` shown to the model, with `error` / `timed_out` set so the
caller counts it (`tool/errors`, `tool/timeouts`). Calls run in daemon threads
(`posttrain.rewards.runner.map_in_daemon_threads`, the reward functions' machinery):
a call that overruns is abandoned, not killed, so code that can hang belongs in the
sandbox (the `python` tool does this).
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from posttrain.rewards.base import map_in_daemon_threads

MAX_RESULT_CHARS = 2000
"""Longest tool result shown to the model; longer ones are cut and end with `...`."""


@dataclass(frozen=True)
class Tool:
    """A callable the model may use, with its JSON schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments (a dict of a chat
    model's JSON arguments, or the raw text between the parentheses)."""

    name: str
    arguments: dict[str, Any] | str


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave: the text shown to the model and whether it failed."""

    text: str
    error: bool = False
    timed_out: bool = False


def as_tool(fn: Callable[..., Any] | Tool) -> Tool:
    """A Tool of `fn`, its schema from type hints and docstring (module docstring)."""
    if isinstance(fn, Tool):
        return fn
    schema = get_json_schema(fn)
    return Tool(schema["function"]["name"], fn, schema)


def tools_by_name(tools: Sequence[Callable[..., Any] | Tool]) -> dict[str, Tool]:
    """name -> Tool; two tools with one name are an error."""
    out: dict[str, Tool] = {}
    for tool in map(as_tool, tools):
        if tool.name in out:
            raise ValueError(f"two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


def bind_arguments(tool: Tool, arguments: Mapping[str, Any] | str) -> dict[str, Any]:
    """The keyword arguments of a call of `tool` (module docstring); ValueError or
    TypeError when they do not fit its signature."""
    signature = inspect.signature(tool.fn)
    params = list(signature.parameters.values())
    if isinstance(arguments, str):
        if len(params) == 1:
            kwargs = {params[0].name: arguments}
        else:
            args, kwargs = _literal_call_arguments(arguments)
            kwargs = dict(signature.bind(*args, **kwargs).arguments)
    else:
        kwargs = dict(arguments)
    bound = signature.bind(**kwargs)
    return {name: _convert(signature.parameters[name], value) for name, value in bound.arguments.items()}


def run_calls(calls: Sequence[ToolCall], tools: Mapping[str, Tool], timeout_s: float) -> list[ToolOutcome]:
    """Run every call concurrently, each within `timeout_s` of the start; one outcome per call."""
    jobs: list[tuple[Tool, dict[str, Any]] | ToolOutcome] = []
    for call in calls:
        tool = tools.get(call.name)
        if tool is None:
            jobs.append(ToolOutcome(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}", True))
            continue
        try:
            jobs.append((tool, bind_arguments(tool, call.arguments)))
        except (TypeError, ValueError, SyntaxError) as e:
            jobs.append(ToolOutcome(f"error: bad arguments for {call.name}: {e}", True))
    todo = [j for j in jobs if not isinstance(j, ToolOutcome)]
    results, errors, _ = map_in_daemon_threads(lambda job: job[0].fn(**job[1]), todo, len(todo), timeout_s)
    outcomes = iter(zip(results, errors))
    out = []
    for job in jobs:
        if isinstance(job, ToolOutcome):
            out.append(job)
            continue
        value, error = next(outcomes)
        if isinstance(error, TimeoutError):
            out.append(ToolOutcome(f"error: {job[0].name} timed out after {timeout_s:g} s", True, True))
        elif error is not None:
            out.append(ToolOutcome(f"error: {type(error).__name__}: {error}", True))
        else:
            out.append(ToolOutcome(_clip(str(value))))
    return out


MODEL_TEXT = "<model text>"
"""The file name `parse_model_text` parses under: Python's SyntaxWarnings for it are silenced."""
warnings.filterwarnings("ignore", category=SyntaxWarning, module=re.escape(MODEL_TEXT))


def parse_model_text(source: str) -> ast.Expression:
    """`ast.parse(source, mode="eval")` of text a model wrote (a tool call's arguments, a
    calculator expression). Text such as `3if` raises SyntaxError, and Python's tokenizer would
    also print `<unknown>:1: SyntaxWarning: invalid decimal literal` to stderr, once per such call,
    into the user's log: the warnings of this file name are filtered (the error still says what
    is wrong, in the tool's result)."""
    return ast.parse(source, filename=MODEL_TEXT, mode="eval")


def _literal_call_arguments(text: str) -> tuple[list[Any], dict[str, Any]]:
    """`"1, 'a', k=3"` -> ([1, 'a'], {'k': 3}): Python call arguments made of literals."""
    call = parse_model_text(f"f({text})").body
    if not isinstance(call, ast.Call):
        raise ValueError(f"cannot read arguments {text!r}")
    args = [ast.literal_eval(a) for a in call.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
    return args, kwargs


def _convert(param: inspect.Parameter, value: Any) -> Any:
    """A value as the parameter's annotated scalar type (str, int, float, bool); others as given."""
    kind = param.annotation
    if isinstance(kind, str):  # `from __future__ import annotations`
        kind = {"str": str, "int": int, "float": float, "bool": bool}.get(kind)
    if kind is bool and isinstance(value, str):
        if value.strip().lower() not in ("true", "false"):
            raise ValueError(f"{param.name} must be true or false, got {value!r}")
        return value.strip().lower() == "true"
    if kind in (int, float) and isinstance(value, bool):
        raise TypeError(f"{param.name} must be a number, got {value!r}")
    if kind in (str, int, float) and not isinstance(value, kind):
        return kind(value.strip() if isinstance(value, str) and kind is not str else value)
    return value


def _clip(text: str) -> str:
    return text if len(text) <= MAX_RESULT_CHARS else text[: MAX_RESULT_CHARS - 3] + "..."
