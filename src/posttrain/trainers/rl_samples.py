"""The training samples an RL run writes to samples.jsonl: the first rows of a step's batch.

One line per row (`train_samples`):

    split        "train"
    prompt       the prompt as the dataset gave it
    completion   the response (an episode: its whole trajectory, model and environment
                 text run together), decoded without special tokens
    score        the sequence reward;  advantage: its mean over the row's trained tokens
    spans        the completion cut where the author or the loss mask changes:
                 {"author": "model" | "environment" | "tool", "text", "tokens": [start, end),
                  "trained": bool}; the texts concatenate to the completion, the
                 `trained` spans' tokens are exactly those with response_mask 1
    episode      multi-turn rows only: {"prompt": the prompt the model saw (with what
                 `reset` added, special tokens kept), "reset": what `env.reset` returned,
                 "env_reward": the episode's environment reward (None when it gave none),
                 "turns": [{"bounds", "text", "reward", "calls": [{name, arguments,
                 result, error}], "error", ...}] (`envs.samples.episode_record`)}

Spans and episode records come from `envs.samples` (which the eval samples use too).
"""

from __future__ import annotations

from typing import Any

from posttrain.envs.samples import spans, token_authors
from posttrain.workers import RLBatch

SAMPLES_PER_LOG = 4
"""Training rows written to samples.jsonl at each logged step (`trainer.logging_steps`)."""


def train_samples(batch: RLBatch, tokenizer, k: int = SAMPLES_PER_LOG) -> list[dict[str, Any]]:
    """The first k rows of a training batch as samples.jsonl lines (module docstring)."""
    adv = batch.advantages.sum(-1) / batch.response_mask.sum(-1).clamp_min(1)
    out = []
    for i in range(min(k, len(batch))):
        length = int(batch.trajectory_lengths[i])
        ids = batch.response_ids[i, :length].tolist()
        trained = [bool(m) for m in batch.response_mask[i, :length].tolist()]
        record = batch.episodes[i] if batch.episodes is not None else None
        authors = token_authors(record, length)
        row = {"split": "train", "prompt": batch.prompts[i], "completion": batch.completions[i],
               "score": float(batch.scores[i]), "advantage": float(adv[i]),
               "spans": spans(tokenizer, ids, authors, trained)}
        if record is not None:
            prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
            env_reward = (batch.columns or {}).get("env_reward", [None] * len(batch))[i]
            row["episode"] = {"prompt": tokenizer.decode(prompt, skip_special_tokens=False),
                              "reset": record["reset"], "env_reward": env_reward, "turns": record["turns"]}
        out.append(row)
    return out
