"""Environments and tools from names and import paths (what a config or the command line gives).

    resolve_environment("guess_number")                  # a built-in environment
    resolve_environment("my_envs.py:Shop")               # a class in a file, by path
    resolve_environment("mypkg.envs:Shop")               # an importable module
    resolve_environment(Shop)                            # a class or factory as it is
    resolve_tools(["calculator", "my_tools.py:lookup"])  # built-in tools and functions
    episode_factory("guess_number", [])                  # what `rollout.env` / `rollout.tools` make

An environment spec resolves to a factory: a callable with no arguments that returns a
fresh `Environment` (a class, as TRL's `environment_factory`). Import paths are read by
`posttrain.rewards.load_object`, the reward functions' loader.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from posttrain.envs.base import Environment
from posttrain.envs.builtin_tools import BUILTIN_TOOLS
from posttrain.envs.games import GuessNumber
from posttrain.envs.task_envs import ArithmeticTools
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.rewards import load_object
from posttrain.rewards.registry import describe_object

BUILTIN_ENVIRONMENTS: dict[str, Callable[[], Environment]] = {
    "arithmetic_tools": ArithmeticTools,
    "guess_number": GuessNumber,
}
"""The built-in environments by name."""


def resolve_environment(spec: str | Callable[[], Environment]) -> Callable[[], Environment]:
    """The environment factory of a built-in name, a `module:Class` / `file.py:Class` path,
    or a callable (returned as it is)."""
    if callable(spec) and not isinstance(spec, str):
        return spec
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"unknown environment {spec!r}: use a built-in ({', '.join(sorted(BUILTIN_ENVIRONMENTS))}), "
            "'module:Class' or 'file.py:Class'"
        )
    factory = _load(spec, "environment")
    if not callable(factory):
        raise ValueError(f"environment {spec!r} is a {type(factory).__name__}, not a class or factory")
    return factory


def resolve_tools(specs: Sequence[str | Callable[..., Any]]) -> list[Callable[..., Any]]:
    """Tool functions of built-in names (`calculator`, `python`), `module:function` /
    `file.py:function` paths, or callables (kept as they are)."""
    out = []
    for spec in specs:
        if callable(spec) and not isinstance(spec, str):
            out.append(spec)
        elif spec in BUILTIN_TOOLS:
            out.append(BUILTIN_TOOLS[spec])
        elif isinstance(spec, str) and ":" in spec:
            out.append(_load(spec, "tool"))
        else:
            raise ValueError(f"unknown tool {spec!r}: use {', '.join(sorted(BUILTIN_TOOLS))} or 'module:function'")
    return out


def episode_factory(
    env: str | Callable[[], Environment] | None, tools: Sequence[str | Callable[..., Any]] = ()
) -> Callable[[], Environment]:
    """The per-episode factory of an environment spec and tool specs (config keys
    `rollout.env`, `rollout.tools`): tools alone make a `ToolEnvironment(tools=...)`; with an
    environment, they are passed as its `tools=` keyword."""
    fns = resolve_tools(tools)
    if env is None:
        if not fns:
            raise ValueError("episodes need an environment or tools (rollout.env / rollout.tools)")
        return partial(ToolEnvironment, tools=fns)
    factory = resolve_environment(env)
    return partial(factory, tools=fns) if fns else factory


def check_environment_columns(factory: Callable[[], Environment], columns: Sequence[str], data: str) -> None:
    """Refuse, before the run, data without a column the environment declares it reads (a
    class attribute `columns`, as the built-ins have: guess_number's `secret`)."""
    needed = getattr(getattr(factory, "func", factory), "columns", ())  # through functools.partial (tools=)
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(
            f"environment {getattr(factory, '__name__', factory)!r} reads the column(s) {missing} of each row, "
            f"which {data} lacks (its columns: {sorted(columns)}); add them, or use another rollout.env"
        )


def describe_episodes(environment: Any = None, tools: Sequence[Any] | None = None) -> dict[str, Any]:
    """How config.yaml records the environment factory and tools the Python API was given
    (`posttrain.rewards.registry.describe_object`: a spec that loads each again, or None)."""
    record: dict[str, Any] = {}
    if environment is not None:
        record["environment_factory"] = ({"spec": environment} if isinstance(environment, str)
                                         else describe_object(environment, BUILTIN_ENVIRONMENTS))
    if tools is not None:
        record["tools"] = [{"spec": t} if isinstance(t, str) else describe_object(t, BUILTIN_TOOLS) for t in tools]
    return record


def _load(spec: str, what: str) -> Any:
    try:
        return load_object(spec)
    except ValueError as e:  # the loader words its errors for rewards
        raise ValueError(f"{what} {spec!r}: {str(e).split(': ', 1)[-1]}") from None
