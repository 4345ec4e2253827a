"""The rollout role: turn a batch of prompts into a batch of responses (n per prompt).

It wraps a `posttrain.rollout` engine (native, hf or vllm). Prompts arrive tokenized
(left-padded ids) and leave repeated n times, rows of a group contiguous, with the
responses, their lengths, whether they were truncated, and the engine's log-probs.

With an environment (`rollout.env` / `rollout.tools`) every response is a multi-turn
episode (`posttrain.envs.play_episodes`), one trajectory per row:

    prompt_ids      the prompt the model saw: the row's prompt plus what `env.reset` added
    response_ids    model turns and environment answers, (B, Tr)
    response_mask   1 on model tokens, 0 on environment tokens and padding
    lengths         model tokens;  total_lengths: model + environment tokens
    completions     the trajectory's text; columns["env_reward"]: the episode's
                    environment reward (None where it gave none)
    episodes        per row what reset() returned and each turn: its token bounds, text,
                    tool calls with results, step reward (`episode_record`)
    meta["episode_metrics"]  turns/mean, turns/max, tool_calls/mean, tool/errors, …

so log-probs (old, reference, current) are computed over the whole sequence and every
loss and estimator sees model tokens only through the mask.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from posttrain.data.collate import left_pad
from posttrain.envs import EnvEpisodes, Environment, play_episodes
from posttrain.envs.samples import episode_record
from posttrain.rollout import Episodes, MultiTurnLimits, RolloutEngine, SamplingParams
from posttrain.workers.batch import RLBatch


def as_completion(prompt: Any, text: str) -> Any:
    """A response as reward functions expect it: the text, or for a chat prompt one
    assistant message (TRL's conversational completions)."""
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": text}]
    return text


@dataclasses.dataclass
class InParts:
    """A batch of episodes played in parts (`Rollout.play_in_parts`)."""

    prompts: RLBatch
    """Its prompts, repeated n times (rows of a group contiguous)."""
    n: int
    game: EnvEpisodes
    ended: RLBatch | None = None
    """The batch, once every episode has ended."""


class Rollout:
    """Sampling from the current policy (veRL's rollout worker; TRL's generation step).

    Args:
        engine: a rollout engine over the policy.
        params: sampling settings; `n` is the group size. `seed` is set per call.
        env_factory: a fresh environment per episode (module docstring); None = single-turn.
        limits: the episodes' turn and token limits (with `env_factory`).
    """

    def __init__(self, engine: RolloutEngine, params: SamplingParams,
                 env_factory: Callable[[], Environment] | None = None, limits: MultiTurnLimits | None = None):
        self.engine, self.params = engine, params
        self.env_factory, self.limits = env_factory, limits or MultiTurnLimits()
        self._next_uid = 0
        self.in_parts: dict[int, InParts] = {}
        """`play_in_parts`' batches in play, by handle."""

    def generate(self, prompts: RLBatch, seed: int, params: SamplingParams | None = None,
                 first: int = 0) -> RLBatch:
        """Responses to every prompt; rows [k·n, (k+1)·n) answer prompt k.

        `seed` makes the samples a function of (weights, prompts, seed). `params`
        replaces the rollout's sampling settings for this call (evaluation). `first`: the
        index of `prompts`' first prompt in a batch generated in slices (Ray's split
        rollout; it needs seed_mode "row", whose rows then draw as the whole batch's rows
        first·n, ...). Needs `prompt_ids`, `prompt_mask` and `prompts`; the prompts' `uid`
        (group ids) are kept when given, else counted from 0 over this rollout's calls."""
        prompts, params = self._call(prompts, seed, params, first)
        if self.env_factory is not None:
            return self._play(prompts, params)
        n = params.n
        ids = [row[mask.bool()].tolist() for row, mask in zip(prompts.prompt_ids, prompts.prompt_mask)]
        out = self.engine.generate(ids, params)
        batch = prompts.repeat(n)
        truncated = torch.tensor([r == "length" for r in out.finish_reason])
        return batch.replace(
            response_ids=out.response_ids,
            response_mask=out.response_mask.long(),
            rollout_logp=out.logprobs,
            lengths=out.lengths,
            truncated=truncated,
            completions=[as_completion(p, t) for p, t in zip(batch.prompts, out.texts)],
            meta={**batch.meta, "n": n},
        )

    def _call(self, prompts: RLBatch, seed: int, params: SamplingParams | None, first: int
              ) -> tuple[RLBatch, SamplingParams]:
        """The prompts with their uid (given, else counted) and the call's sampling settings."""
        prompts.require("prompt_ids", "prompt_mask", "prompts", role="rollout.generate")
        params = params or self.params
        params = dataclasses.replace(params, seed=seed, first_row=first * params.n)
        uid = prompts.uid  # given by the driver (its prompt stream counts them), else counted here
        if uid is None:
            uid = torch.arange(self._next_uid, self._next_uid + len(prompts))
            self._next_uid += len(prompts)
        return prompts.replace(uid=uid), params

    def play_in_parts(self, prompts: RLBatch, seed: int, handle: int, begin: bool, tokens: int, version: int,
                      live: list[int], first: int = 0) -> RLBatch | None:
        """Partial rollouts of episodes (`trainers.rl_partial.PartialEpisodes`): up to `tokens`
        more model tokens per running episode of the batch `handle`, with the engine's weights now
        (`version`, recorded per token in `versions`). `begin`: start the batch's episodes (its
        environments are kept here, `envs.EnvEpisodes`, until it ends); else go on with them
        (`prompts`, `seed`, `first` as given at the start). Returns the batch as `generate` would,
        per-token `versions` added, once every episode has ended (again at each later call), else
        None. Batches not in `live` (the ones the driver still waits for) are dropped."""
        for h in [h for h in self.in_parts if h not in live and h != handle]:
            del self.in_parts[h]
        if begin:
            prompts, params = self._call(prompts, seed, None, first)
            game = EnvEpisodes(self.engine, self._rows(prompts), self.env_factory, params, self.limits)
            self.in_parts[handle] = InParts(prompts.repeat(params.n), params.n, game)
        held = self.in_parts.get(handle)
        if held is None:
            raise RuntimeError(f"rollout: the episodes of batch {handle} are not held by this worker (it was "
                               "restarted, or the batch was dropped): the driver must start them again")
        if held.ended is None and held.game.advance(self.engine, tokens, version):
            out, env_rewards, metrics = held.game.result()
            held.ended = episode_batch(held.prompts, held.n, out, env_rewards, metrics).replace(versions=out.versions)
        return held.ended

    def _play(self, prompts: RLBatch, params: SamplingParams) -> RLBatch:
        """`params.n` episodes of every prompt (module docstring)."""
        out, env_rewards, metrics = play_episodes(self.engine, self._rows(prompts), self.env_factory, params,
                                                  self.limits)
        return episode_batch(prompts.repeat(params.n), params.n, out, env_rewards, metrics)

    @staticmethod
    def _rows(prompts: RLBatch) -> list[dict[str, Any]]:
        """The dataset rows of the prompts, as environments' `reset` reads them."""
        columns = prompts.columns or {}
        return [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts.prompts)]

    def offload(self) -> None:
        """Before the update: the engine gives back the GPU memory it holds (vllm sleeps)."""
        self.engine.offload()

    def sync_weights(self, model: nn.Module) -> None:
        """Sample from `model`'s current weights from the next call on (the engine resumes
        first: vllm wakes up, then loads the weights and drops its prefix cache)."""
        self.engine.resume()
        self.engine.sync_weights(model)



def episode_batch(batch: RLBatch, n: int, out: Episodes, env_rewards: torch.Tensor,
                  metrics: dict[str, float]) -> RLBatch:
    """`batch` (the prompts, already repeated `n` times) with the episodes `out` as its
    responses (module docstring)."""
    prompt_ids, prompt_mask = left_pad(out.prompt_ids, out.pad_token_id)
    rewards = [None if math.isnan(r) else r for r in env_rewards.tolist()]
    return batch.replace(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=out.response_ids,
        response_mask=out.response_mask.long(),
        rollout_logp=out.logprobs,
        lengths=out.lengths,
        total_lengths=out.total_lengths,
        truncated=out.truncated.clone(),
        completions=[as_completion(p, t) for p, t in zip(batch.prompts, out.texts)],
        episodes=[episode_record(out, i) for i in range(len(out))],
        columns={**(batch.columns or {}), "env_reward": rewards},
        meta={**batch.meta, "n": n, "episode_metrics": metrics},
    )

