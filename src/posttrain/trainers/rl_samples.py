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
                 result, error}], "error", ...}] (`rollout_worker.episode_record`)}

An environment's answer is a "tool" span when the model turn before it called a tool,
else an "environment" span. Span texts are cut at character offsets of the decoded
prefixes (`span_texts`), so they concatenate to the completion exactly even where a token
decodes differently alone (a SentencePiece word's leading space).
"""

from __future__ import annotations

from typing import Any

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


def token_authors(record: dict[str, Any] | None, length: int) -> list[str]:
    """Who wrote each of a response's `length` tokens: all "model" for a single-turn
    response (record None); for an episode, per turn its model tokens, then its answer,
    "tool" when the turn called a tool, else "environment"."""
    if record is None:
        return ["model"] * length
    authors = ["model"] * length
    for turn in record["turns"]:
        _, model_end, end = turn["bounds"]
        called = bool(turn.get("calls")) or int(turn.get("tool_calls", 0)) > 0
        authors[model_end:end] = ["tool" if called else "environment"] * (end - model_end)
    return authors


def spans(tokenizer, ids: list[int], authors: list[str], trained: list[bool]) -> list[dict[str, Any]]:
    """Maximal runs of tokens with the same (author, trained), each with its text (`span_texts`)."""
    cuts = [0] + [t for t in range(1, len(ids)) if (authors[t], trained[t]) != (authors[t - 1], trained[t - 1])]
    bounds = list(zip(cuts, [*cuts[1:], len(ids)])) if ids else []
    texts = span_texts(tokenizer, ids, [end for _, end in bounds])
    return [{"author": authors[s], "text": text, "tokens": [s, e], "trained": trained[s]}
            for (s, e), text in zip(bounds, texts)]


def span_texts(tokenizer, ids: list[int], ends: list[int]) -> list[str]:
    """The decoded text of `ids` (special tokens skipped) cut after each token count in
    `ends` (increasing, the last len(ids)): piece j is text[c_{j-1}:c_j], c_j the length of
    the decoded prefix ids[:ends[j]] (kept monotone), so the pieces join to the whole text."""
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    cuts, last = [], 0
    for end in ends:
        c = len(whole) if end >= len(ids) else len(tokenizer.decode(ids[:end], skip_special_tokens=True))
        last = min(max(last, c), len(whole))
        cuts.append(last)
    return [whole[a:b] for a, b in zip([0, *cuts[:-1]], cuts)]
