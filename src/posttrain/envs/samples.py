"""Episodes as samples.jsonl shows them: who wrote each span of a trajectory, which spans the
loss trains on, and each turn's text, tool calls and reward.

    record = episode_record(episodes, row)        # {"reset", "turns": [{"bounds", "text", "calls", ...}]}
    authors = token_authors(record, length)       # "model" | "tool" | "environment" per token
    spans(tokenizer, ids, authors, trained)       # [{"author", "text", "tokens", "trained"}]
    episode_fields(tokenizer, episodes, row, ...) # the "spans" and "episode" of one sample line

An environment's answer is a "tool" span when the model turn before it called a tool,
else an "environment" span. Span texts are cut at character offsets of the decoded
prefixes (`span_texts`), so they concatenate to the completion exactly even where a token
decodes differently alone (a SentencePiece word's leading space). The training rows
(`trainers.rl_samples`) and the eval samples (`evaluation`) of a multi-turn run both use it.
"""

from __future__ import annotations

from typing import Any

from posttrain.rollout import Episodes


def episode_record(out: Episodes, row: int) -> dict[str, Any]:
    """Row `row` of `out` as samples.jsonl shows it: `reset` (the text `env.reset` added to
    the prompt, or None) and `turns`, one per model turn: `bounds` (start, model_end, end)
    in response columns (`Episodes.turn_bounds`), `text` (the turn as the environment read
    it), `reward` (the step's, or None), `calls` (tool calls with their results), `error`
    (the step raised or timed out, else None), and the step's other counts."""
    turns = []
    for bounds, text, info in zip(out.turn_bounds[row], out.turn_texts[row], out.infos[row]):
        rest = {k: v for k, v in info.items() if k not in ("reward", "calls", "env_error")}
        turns.append({"bounds": list(bounds), "text": text, "reward": info.get("reward"),
                      "calls": list(info.get("calls", [])), "error": info.get("env_error"), **rest})
    return {"reset": out.resets[row] if out.resets else None, "turns": turns}


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


def episode_fields(tokenizer, out: Episodes, row: int, env_reward: float | None,
                   trained: list[bool] | None = None) -> dict[str, Any]:
    """`spans` and `episode` of row `row` of `out` for a sample line: `trained` the row's
    loss mask over its trajectory (default: the model's tokens, `Episodes.response_mask`),
    `env_reward` the episode's environment reward (None for none)."""
    length = int(out.total_lengths[row])
    ids = out.response_ids[row, :length].tolist()
    if trained is None:
        trained = [bool(m) for m in out.response_mask[row, :length].tolist()]
    record = episode_record(out, row)
    return {"spans": spans(tokenizer, ids, token_authors(record, length), trained),
            "episode": {"prompt": tokenizer.decode(out.prompt_ids[row], skip_special_tokens=False),
                        "reset": record["reset"], "env_reward": env_reward, "turns": record["turns"]}}
