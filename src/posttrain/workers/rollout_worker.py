"""The rollout role: turn a batch of prompts into a batch of responses (n per prompt).

It wraps a `posttrain.rollout` engine (native, hf or vllm). Prompts arrive tokenized
(left-padded ids) and leave repeated n times, rows of a group contiguous, with the
responses, their lengths, whether they were truncated, and the engine's log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from posttrain.rollout import RolloutEngine, SamplingParams
from posttrain.workers.batch import RLBatch


def as_completion(prompt: Any, text: str) -> Any:
    """A response as reward functions expect it: the text, or for a chat prompt one
    assistant message (TRL's conversational completions)."""
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": text}]
    return text


class Rollout:
    """Sampling from the current policy (veRL's rollout worker; TRL's generation step).

    Args:
        engine: a rollout engine over the policy.
        params: sampling settings; `n` is the group size. `seed` is set per call.
    """

    def __init__(self, engine: RolloutEngine, params: SamplingParams):
        self.engine, self.params = engine, params
        self._next_uid = 0

    def generate(self, prompts: RLBatch, seed: int, params: SamplingParams | None = None) -> RLBatch:
        """Responses to every prompt; rows [k·n, (k+1)·n) answer prompt k.

        `seed` makes the samples a function of (weights, prompts, seed). `params`
        replaces the rollout's sampling settings for this call (evaluation). Needs
        `prompt_ids`, `prompt_mask` and `prompts`."""
        prompts.require("prompt_ids", "prompt_mask", "prompts", role="rollout.generate")
        params = dataclasses.replace(params or self.params, seed=seed)
        n = params.n
        ids = [row[mask.bool()].tolist() for row, mask in zip(prompts.prompt_ids, prompts.prompt_mask)]
        out = self.engine.generate(ids, params)
        uid = torch.arange(self._next_uid, self._next_uid + len(prompts))
        self._next_uid += len(prompts)
        batch = prompts.replace(uid=uid).repeat(n)
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

    def offload(self) -> None:
        """Before the update: the engine gives back the GPU memory it holds (vllm sleeps)."""
        self.engine.offload()

    def sync_weights(self, model: nn.Module) -> None:
        """Sample from `model`'s current weights from the next call on (the engine resumes
        first: vllm wakes up, then loads the weights and drops its prefix cache)."""
        self.engine.resume()
        self.engine.sync_weights(model)
