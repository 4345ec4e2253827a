"""Environments in the rollout: one environment per episode, driving an engine's episode loop.

    episodes, rewards, metrics = play_episodes(engine, rows, lambda: ToolEnvironment([calculator]),
                                               params, MultiTurnLimits(max_turns=4, max_total_tokens=256))

Notation: B dataset rows, n = params.n episodes per row, N = B·n.

- Every episode gets its own environment from `env_factory()` (TRL's
  `environment_factory`), reset on its row; the text `reset` returns is appended to the
  row's prompt (a string prompt) or the tools go to the chat template (a message list,
  `chat.render_prompt`). The environments are built and reset concurrently, one daemon
  thread each, under `limits.env_timeout_s` (`start_environments`).
- `EnvironmentTurns` is the rollout's `TurnHandler`: the turns that ended in one loop
  iteration are stepped concurrently (one daemon thread each, `limits.env_timeout_s` for
  all; tools inside a step have their own timeouts).
- Every environment call is counted the same way when it fails: a constructor, `reset` or
  `step` that raises (`sys.exit` included) or overruns, a `reset` that returns something
  other than a string or None, a `step` whose result is malformed (not a StepResult; a
  reward that is not a finite number or None; info that is not a dict; an observation that
  is not a string). Its episode ends (one that did not start ends after its first model
  turn, on the row's bare prompt), the reason is kept in the turn's info (`env_error`,
  counted in `env/errors`, the user's file:line included), and the run goes on. The first
  start failure of a batch is logged in one line, as `user_code` says errors.
- The observation is tokenised without special tokens (the text protocol), or rendered
  by the chat template as tool messages (`chat.ChatProtocol.format_results`), and appended.
- Environment reward of an episode: the sum of its steps' rewards (None when no step gave
  one), `rewards` (N,) float with NaN for None.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch

from posttrain.envs.base import Environment, StepResult
from posttrain.rewards.base import map_in_daemon_threads
from posttrain.rollout import Episodes, MultiTurnLimits, Reply, SamplingParams
from posttrain.training.core import merge_metrics
from posttrain.user_code import name_of, raised

log = logging.getLogger(__name__)


class EnvironmentTurns:
    """The `TurnHandler` over one environment per output row (module docstring); `failed`
    maps the rows whose environment did not start to the reason, so their first turn ends them."""

    def __init__(self, envs: Sequence[Environment | None], tokenizer, timeout_s: float = 60.0,
                 failed: dict[int, str] | None = None):
        self.envs, self.tokenizer, self.timeout_s = list(envs), tokenizer, timeout_s
        self.failed = dict(failed or {})

    def respond(self, rows: list[int], texts: list[str]) -> list[Reply]:
        jobs = [(row, text) for row, text in zip(rows, texts) if row not in self.failed]
        results, errors, _ = map_in_daemon_threads(
            lambda job: self.envs[job[0]].step(job[1]), jobs, len(jobs), self.timeout_s
        )
        answers = {row: (result, error) for (row, _), result, error in zip(jobs, results, errors)}
        replies = []
        for row in rows:
            if row in self.failed:
                replies.append(_ended(self.failed[row]))
                continue
            result, error = answers[row]
            problem = f"step raised {raised(error)}" if error is not None else _malformed_step(result)
            if problem is not None:
                replies.append(_ended(problem))
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
) -> tuple[Episodes, torch.Tensor, dict[str, float]]:
    """`params.n` episodes of every row; returns (episodes, environment rewards (N,), metrics).

    The environment's stop strings (`env.protocol.stop`, if it has a protocol) are added to
    `params.stop`. Rows need a `prompt` (a string, or chat messages for a chat model)."""
    game = _Game.start(engine, rows, env_factory, params, limits)
    return game.result(engine.generate_episodes(game.prompts, game.params, limits, game.turns))


class EnvEpisodes:
    """`play_episodes` in parts (partial rollouts, `trainers.rl_partial`): the episodes and their
    environments stay here between `advance` calls, each of which may run on other weights.
    Needs an engine that runs the token loop (`rollout.episodes.PlaysEpisodes`: native, hf).

        game = EnvEpisodes(engine, rows, env_factory, params, limits)
        while not game.advance(engine, tokens=64, version=v): ...   # a weight sync between calls
        episodes, rewards, metrics = game.result()
    """

    def __init__(self, engine, rows: Sequence[dict[str, Any]], env_factory: Callable[[], Environment],
                 params: SamplingParams, limits: MultiTurnLimits):
        self.game = _Game.start(engine, rows, env_factory, params, limits)
        self.play = engine.start_episodes(self.game.prompts, self.game.params, limits, self.game.turns)

    def advance(self, engine, tokens: int, version: int) -> bool:
        """Up to `tokens` more model tokens per running episode with `engine`'s weights now, each
        recorded as `version`'s (`Episodes.versions`); returns whether every episode has ended."""
        return engine.advance(self.play, tokens, version)

    def result(self) -> tuple[Episodes, torch.Tensor, dict[str, float]]:
        """`play_episodes`'s result, once `advance` said every episode ended."""
        return self.game.result(self.play.episodes())


@dataclasses.dataclass
class _Game:
    """The episodes of some rows before they are played: their environments started and reset,
    the prompts the model sees, the turn handler over the environments."""

    n: int
    prompts: list[str | list[int]]
    params: SamplingParams
    """The call's sampling settings: n = 1 per prompt (each row given n times), the
    environment's stop strings added."""
    turns: EnvironmentTurns
    extras: list[str | None]

    @classmethod
    def start(cls, engine, rows: Sequence[dict[str, Any]], env_factory: Callable[[], Environment],
              params: SamplingParams, limits: MultiTurnLimits) -> _Game:
        if not rows:
            raise ValueError("play_episodes needs at least one row")
        n, what = params.n, f"environment {name_of(env_factory)!r}"
        each = [row for row in rows for _ in range(n)]
        envs, extras, failed = start_environments(env_factory, each, limits.env_timeout_s, what)
        prompts = [_prompt(engine.tokenizer, env, row, extra) for env, row, extra in zip(envs, each, extras)]
        protocol = next((getattr(env, "protocol", None) for env in envs if env is not None), None)
        stop = tuple(dict.fromkeys([*params.stop, *getattr(protocol, "stop", ())]))
        one = dataclasses.replace(params, n=1, stop=stop)
        return cls(n, prompts, one, EnvironmentTurns(envs, engine.tokenizer, limits.env_timeout_s, failed), extras)

    def result(self, out: Episodes) -> tuple[Episodes, torch.Tensor, dict[str, float]]:
        """(episodes, environment rewards (N,), metrics) of the episodes played."""
        out.prompt_index = torch.arange(len(out)) // self.n  # each row was given n times
        out.resets = self.extras
        rewards = torch.tensor([_episode_reward(i) for i in out.infos], dtype=torch.float32)
        return out, rewards, episode_metrics(out, rewards)


def start_environments(
    env_factory: Callable[[], Environment], rows: Sequence[dict[str, Any]], timeout_s: float, what: str
) -> tuple[list[Environment | None], list[str | None], dict[int, str]]:
    """One environment per row, built and reset on it concurrently under one `timeout_s`:
    (environments, the text each `reset` returned, {row: reason} for those that raised, ran
    past `timeout_s` or returned something other than a string or None; their environment is
    None). The first failure is logged in one line, as `user_code` says errors."""
    stage = ["constructor"] * len(rows)

    def start(i: int) -> tuple[Environment, Any]:
        env = env_factory()
        stage[i] = "reset"
        return env, env.reset(rows[i])

    results, errors, _ = map_in_daemon_threads(start, range(len(rows)), len(rows), timeout_s)
    envs: list[Environment | None] = [None] * len(rows)
    extras: list[str | None] = [None] * len(rows)
    failed: dict[int, str] = {}
    for i, (result, error) in enumerate(zip(results, errors)):
        if error is not None:
            failed[i] = f"{stage[i]} raised {raised(error)}"
        elif result[1] is not None and not isinstance(result[1], str):
            failed[i] = f"reset returned {_show(result[1])}, not a string or None"
        else:
            envs[i], extras[i] = result
    if failed:
        first = min(failed)
        log.warning("%s: %d of %d episodes could not start and end at once (counted in env/errors); the first: %s",
                    what, len(failed), len(rows), f"{what} {failed[first]}")
    return envs, extras, failed


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


def _prompt(tokenizer, env: Environment | None, row: dict[str, Any], extra: str | None) -> str | list[int]:
    """The prompt the model sees: the row's prompt with the text `reset` returned appended."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt + (extra or "")
    from posttrain.envs.chat import render_prompt

    text = render_prompt(tokenizer, prompt, getattr(env, "schemas", None))
    return tokenizer(text + (extra or ""), add_special_tokens=False)["input_ids"]


def _malformed_step(result: Any) -> str | None:
    """What is wrong with what `step` returned, or None: a StepResult with a bool `done`, a
    finite number or None as `reward`, a dict as `info`, a string `observation` unless done."""
    if not isinstance(result, StepResult):
        return f"step returned {_show(result)}, not a StepResult"
    reward = result.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        return f"step returned reward {_show(reward)}, not a finite number or None"
    if not isinstance(result.info, dict):
        return f"step returned info {_show(result.info)}, not a dict"
    if not isinstance(result.done, (bool, numpy.bool_)):
        return f"step returned done {_show(result.done)}, not a bool"
    if not result.done and not isinstance(result.observation, str):
        return f"step returned observation {_show(result.observation)}, not a string"
    return None


def _ended(reason: str) -> Reply:
    """The reply that ends an episode whose environment failed; `reason` goes to env/errors' log."""
    return Reply([], done=True, info={"env_error": reason})


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return f"{text if len(text) <= limit else text[: limit - 3] + '...'} ({type(value).__name__})"


def _episode_reward(infos: list[dict]) -> float:
    given = [i["reward"] for i in infos if i.get("reward") is not None]
    return float(sum(given)) if given else math.nan
