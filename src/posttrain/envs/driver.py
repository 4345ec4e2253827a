"""Environments in the rollout: one environment per episode, driving an engine's episode loop.

    episodes, rewards, metrics = play_episodes(engine, rows, lambda: ToolEnvironment([calculator]),
                                               params, MultiTurnLimits(max_turns=4, max_total_tokens=256))

Notation: B dataset rows, n = params.n episodes per row, N = B·n.

- Every episode gets its own environment from `env_factory()` (TRL's
  `environment_factory`), reset on its row (an exception in either stops the run with a
  `user_code.UserCodeError` naming the environment and the line that raised); the text `reset` returns is appended to the
  row's prompt (a string prompt) or the tools go to the chat template (a message list,
  `chat.render_prompt`).
- `EnvironmentTurns` is the rollout's `TurnHandler`: the turns that ended in one loop
  iteration are stepped concurrently (one daemon thread each, `step_timeout_s` for all;
  tools inside a step have their own timeouts). A step that raises or overruns ends its
  episode and is counted in `env/errors`; it never crashes the rollout.
- The observation is tokenised without special tokens (the text protocol), or rendered
  by the chat template as tool messages (`chat.ChatProtocol.format_results`), and appended.
- Environment reward of an episode: the sum of its steps' rewards (None when no step gave
  one), `rewards` (N,) float with NaN for None.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from posttrain.envs.base import Environment, StepResult
from posttrain.rewards.runner import map_in_daemon_threads
from posttrain.rollout import Episodes, MultiTurnLimits, Reply, SamplingParams
from posttrain.training.core import merge_metrics
from posttrain.user_code import name_of, user_code


class EnvironmentTurns:
    """The `TurnHandler` over one environment per output row (module docstring)."""

    def __init__(self, envs: Sequence[Environment], tokenizer, step_timeout_s: float = 60.0):
        self.envs, self.tokenizer, self.step_timeout_s = list(envs), tokenizer, step_timeout_s

    def respond(self, rows: list[int], texts: list[str]) -> list[Reply]:
        jobs = list(zip(rows, texts))
        results, errors, _ = map_in_daemon_threads(
            lambda job: self.envs[job[0]].step(job[1]), jobs, len(jobs), self.step_timeout_s
        )
        replies = []
        for result, error in zip(results, errors):
            if error is not None or not isinstance(result, StepResult):
                what = error if error is not None else TypeError(f"step returned {type(result).__name__}")
                replies.append(Reply([], done=True, info={"env_error": f"{type(what).__name__}: {what}"}))
                continue
            tokens = [] if result.done else self.tokenizer(result.observation, add_special_tokens=False)["input_ids"]
            info = {**result.info, "reward": result.reward, "done": result.done}
            replies.append(Reply(list(tokens), result.done, info))
        return replies


def play_episodes(
    engine,
    rows: Sequence[dict[str, Any]],
    env_factory: Callable[[], Environment],
    params: SamplingParams,
    limits: MultiTurnLimits,
    step_timeout_s: float = 60.0,
) -> tuple[Episodes, torch.Tensor, dict[str, float]]:
    """`params.n` episodes of every row; returns (episodes, environment rewards (N,), metrics).

    The environment's stop strings (`env.protocol.stop`, if it has a protocol) are added to
    `params.stop`. Rows need a `prompt` (a string, or chat messages for a chat model)."""
    if not rows:
        raise ValueError("play_episodes needs at least one row")
    n, what = params.n, f"environment {name_of(env_factory)!r}"
    with user_code(what):
        envs = [env_factory() for _ in rows for _ in range(n)]
    started = [_prompt(engine.tokenizer, env, row, what) for env, row in zip(envs, (r for r in rows for _ in range(n)))]
    prompts = [prompt for prompt, _ in started]
    protocol = getattr(envs[0], "protocol", None)
    stop = tuple(dict.fromkeys([*params.stop, *getattr(protocol, "stop", ())]))
    one = dataclasses.replace(params, n=1, stop=stop)
    out = engine.generate_episodes(prompts, one, limits, EnvironmentTurns(envs, engine.tokenizer, step_timeout_s))
    out.prompt_index = torch.arange(len(out)) // n  # each row was given n times
    out.resets = [extra for _, extra in started]
    rewards = torch.tensor([_episode_reward(i) for i in out.infos], dtype=torch.float32)
    return out, rewards, episode_metrics(out, rewards)


def episode_metrics(episodes: Episodes, rewards: torch.Tensor) -> dict[str, float]:
    """turns/mean, turns/max, tool_calls/mean (per episode), tool/errors, tool/timeouts,
    env/errors (summed over the batch), env/reward/mean (over episodes with a reward; NaN if
    none), episode/truncated (fraction ended by a turn or token limit)."""
    def total(key: str) -> list[int]:
        return [sum(int(i.get(key, 0)) for i in infos) for infos in episodes.infos]

    given = rewards[~rewards.isnan()]
    return {
        "turns/mean": float(episodes.turns.float().mean()),
        "turns/max": float(episodes.turns.max()),
        "tool_calls/mean": sum(total("tool_calls")) / len(episodes),
        "tool/errors": float(sum(total("tool_errors"))),
        "tool/timeouts": float(sum(total("tool_timeouts"))),
        "env/errors": float(sum(1 for infos in episodes.infos for i in infos if "env_error" in i)),
        "env/reward/mean": float(given.mean()) if len(given) else math.nan,
        "episode/truncated": float(episodes.truncated.float().mean()),
    }


EPISODE_COUNTS = ("tool/errors", "tool/timeouts", "env/errors")
"""Episode metrics that count events over a batch (summed when batches are merged)."""


def merge_episode_metrics(parts: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The `episode_metrics` of several batches, (rows, metrics) each, as one: means weighted
    by rows (env/reward/mean over the batches that had one, NaN if none did), turns/max the
    max, EPISODE_COUNTS summed."""
    given = [(n, m) for n, m in parts if not math.isnan(m["env/reward/mean"])]
    out = merge_metrics([(n, {k: v for k, v in m.items() if k != "env/reward/mean"}) for n, m in parts])
    for key in EPISODE_COUNTS:
        out[key] = float(sum(m.get(key, 0.0) for _, m in parts))
    out["env/reward/mean"] = merge_metrics(given)["env/reward/mean"] if given else math.nan
    return out


def _prompt(tokenizer, env: Environment, row: dict[str, Any], what: str) -> tuple[str | list[int], str | None]:
    """(the prompt the model sees, the text `env.reset(row)` returned)."""
    with user_code(what):
        extra = env.reset(row)
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt + (extra or ""), extra
    from posttrain.envs.chat import render_prompt

    text = render_prompt(tokenizer, prompt, getattr(env, "schemas", None))
    return tokenizer(text + (extra or ""), add_special_tokens=False)["input_ids"], extra


def _episode_reward(infos: list[dict]) -> float:
    given = [i["reward"] for i in infos if i.get("reward") is not None]
    return float(sum(given)) if given else math.nan
