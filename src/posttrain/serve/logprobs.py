"""Log-probabilities of generated tokens, as OpenAI's `logprobs` fields return them.

Notation: R rows (completions), T tokens, V vocab, k = top log-probs asked for.

What is returned is the model's own distribution, log softmax(logits)[token] at temperature
1 and before top-k/top-p/min-p filtering, whatever the request sampled with (vLLM's
default `raw_logprobs`; the RL engines' temperature-scaled log-probs are another thing,
`rollout.base`). They come from one teacher-forced forward of prompt + completion after
the completion is sampled (`score`), so every engine returns the same numbers, and the k
most likely tokens at each position with them. One entry per generated token
(`usage.completion_tokens` of them: a stop token or stop string included).

Shapes (`chat_logprobs`, `completion_logprobs`):
  chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                "logprob", "bytes"}] (k of them)}], "refusal": None}
  completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}]
                (the k most likely, and the chosen token), "text_offset": [...]}
A token's text is `tokenizer.decode([id])` (vLLM's; a piece of a multi-byte character
decodes to U+FFFD), its `bytes` the bytes it stands for (`token_bytes`: a byte-level BPE
token's bytes, a SentencePiece byte-fallback `<0xNN>`'s byte), so the bytes of a choice's
tokens join to its text's UTF-8 (special tokens aside); `text_offset` is where each token
starts in the completion's text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from posttrain.models.loading import forward_logits

MAX_LOGPROBS = 20
"""Most top log-probs a request may ask for (OpenAI's limit for chat, vLLM's default)."""


@dataclass
class TokenLogprobs:
    """One completion's tokens with their log-probs (module docstring)."""

    ids: list[int]
    """(T,) the generated token ids."""
    logprobs: list[float]
    """(T,) log softmax(logits)[id] of each."""
    top_ids: list[list[int]]
    """(T, k) the k most likely ids at each position, most likely first."""
    top_logprobs: list[list[float]]
    """(T, k) their log-probs."""


@torch.no_grad()
def score(model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
          k: int) -> list[TokenLogprobs]:
    """Teacher-forced log-probs of each completion after its prompt, and the top k.

    One forward of the R rows right-padded to the longest prompt + completion; row r's
    token t is predicted by the logits at position len(prompt_r) + t - 1."""
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    was_training = model.training
    model.eval()
    try:
        logits = forward_logits(model, ids.to(device), mask.to(device))
    finally:
        model.train(was_training)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        logp = torch.log_softmax(logits[i, len(p) - 1 : len(p) + len(c) - 1].float(), dim=-1).cpu()
        chosen = torch.tensor(list(c), dtype=torch.long)
        top = logp.topk(k, dim=-1) if k else None
        out.append(TokenLogprobs(
            ids=list(c),
            logprobs=logp.gather(-1, chosen[:, None])[:, 0].tolist(),
            top_ids=top.indices.tolist() if top is not None else [[] for _ in c],
            top_logprobs=top.values.tolist() if top is not None else [[] for _ in c],
        ))
    return out


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte, reversed: printable Latin-1 bytes
    stand for themselves, the other 68 for chr(256), chr(257), ... in byte order (GPT-2's
    `bytes_to_unicode`, which the ByteLevel pre-tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes token `token_id` stands for: a special token's text; `<0xNN>` (SentencePiece
    byte fallback) that byte; a byte-level BPE token (every character a GPT-2 byte stand-in)
    its bytes; else its piece's UTF-8 with SentencePiece's ▁ as a space."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids or piece is None:
        return tokenizer.decode([token_id]).encode("utf-8")
    if match := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    if _byte_level(tokenizer):
        return bytes(_byte_decoder()[c] for c in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


def _byte_level(tokenizer) -> bool:
    """The tokenizer's pieces are GPT-2 byte stand-ins (its decoder is ByteLevel: GPT-2,
    Llama 3, Qwen, the built-in tokenizer)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return "ByteLevel" in repr(decoder)


def chat_logprobs(tokenizer, row: TokenLogprobs) -> dict:
    """The chat choice's `logprobs` object of `row`."""
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([token_id]), "logprob": logprob,
                "bytes": list(token_bytes(tokenizer, token_id))}

    content = [
        {**entry(row.ids[t], row.logprobs[t]),
         "top_logprobs": [entry(i, lp) for i, lp in zip(row.top_ids[t], row.top_logprobs[t])]}
        for t in range(len(row.ids))
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, row: TokenLogprobs) -> dict:
    """The completions choice's `logprobs` object of `row`; `text_offset`: each token's
    first character in the completion (the tokens' texts laid end to end)."""
    tokens = [tokenizer.decode([i]) for i in row.ids]
    offsets = [len(tokenizer.decode(row.ids[:j], skip_special_tokens=True)) for j in range(len(tokens))]
    top = []
    for t, token in enumerate(tokens):
        best = {tokenizer.decode([i]): lp for i, lp in zip(row.top_ids[t], row.top_logprobs[t])}
        top.append({**best, token: row.logprobs[t]})
    return {"tokens": tokens, "token_logprobs": list(row.logprobs), "top_logprobs": top,
            "text_offset": offsets}
