"""Environments and tools for multi-turn episodes (agentic RL).

    from posttrain.envs import ToolEnvironment, calculator, play_episodes

    env_factory = lambda: ToolEnvironment(tools=[calculator])   # one per episode
    episodes, env_rewards, metrics = play_episodes(engine, rows, env_factory, params, limits)
    episodes.response_mask   # (N, T): 1 on model tokens, 0 on the environment's answers

- base.py: `Environment` (`reset(row) -> str | None`, `step(action) -> StepResult`).
- tools.py: tools from plain functions, their JSON schemas (transformers'
  `get_json_schema`), concurrent calls under a timeout that never crash.
- builtin_tools.py: `calculator` (ast, never eval), `python` (the sandbox).
- text_protocol.py: `<call>calculator(23*47)</call>` -> `<result>1081</result>`, for the
  built-in byte tokenizer.
- chat.py: the chat-template path for HF chat models (`apply_chat_template(tools=...)`,
  `tokenizer.parse_response`).
- tool_env.py: `ToolEnvironment`; games.py: `GuessNumber` (higher / lower feedback);
  task_envs.py: `ArithmeticTools` (the `arithmetic_tools` task's calculator and scorer).
- driver.py: one environment per episode in the rollout's episode loop
  (`rollout.episodes`), environment rewards and the episode metrics; `EnvEpisodes` plays
  them in parts, the environments kept between parts (partial rollouts).
- registry.py: environments and tools from built-in names, `module:attr` or `file.py:attr`.
- samples.py: an episode as samples.jsonl shows it (spans by author and loss mask, turns,
  tool calls and results).

Layer: above `rollout` and `rewards` (it drives the one and runs tools with the other's
thread and sandbox machinery), below `workers`.
"""

from posttrain.envs.base import Environment, StepResult
from posttrain.envs.builtin_tools import BUILTIN_TOOLS, calculator, python
from posttrain.envs.chat import ChatProtocol, render_prompt
from posttrain.envs.driver import (
    EnvEpisodes,
    EnvironmentTurns,
    episode_metrics,
    merge_episode_metrics,
    play_episodes,
)
from posttrain.envs.games import GuessNumber
from posttrain.envs.registry import (
    BUILTIN_ENVIRONMENTS,
    episode_factory,
    resolve_environment,
    resolve_tools,
)
from posttrain.envs.task_envs import ArithmeticTools
from posttrain.envs.text_protocol import TextProtocol, format_call, format_results, parse_calls
from posttrain.envs.tool_env import ToolEnvironment
from posttrain.envs.tools import Tool, ToolCall, ToolOutcome, as_tool, run_calls

__all__ = [
    "ArithmeticTools",
    "BUILTIN_ENVIRONMENTS",
    "BUILTIN_TOOLS",
    "ChatProtocol",
    "EnvEpisodes",
    "Environment",
    "EnvironmentTurns",
    "GuessNumber",
    "StepResult",
    "TextProtocol",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolOutcome",
    "as_tool",
    "calculator",
    "episode_factory",
    "episode_metrics",
    "format_call",
    "format_results",
    "merge_episode_metrics",
    "parse_calls",
    "play_episodes",
    "python",
    "render_prompt",
    "resolve_environment",
    "resolve_tools",
    "run_calls",
]
