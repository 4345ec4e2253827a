"""The hf engine's `EpisodeModel`: re-encode the history after an environment answer.

Notation: R rows held, S the longest history (prompt + trajectory so far), V vocab.

Each row keeps its whole token history. A chunk of one token (plain decoding) is one
forward with transformers' cache; a wider chunk (an environment answer), or
the first feed after rows left the batch, re-encodes every held row from its first token
(left-padded to S, positions from the mask), which also drops the finished rows' cache.
That costs a prefill of the whole history per environment turn: the price of running any
causal LM; the native engine avoids it (`native_episodes`).
"""

from __future__ import annotations

import inspect

import torch

from posttrain.data.collate import left_pad


class HFEpisodeModel:
    """Episodes over a transformers causal LM (module docstring)."""

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        # Newer transformers 5.x name the cache argument `cache` and deprecate `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def start(self, prompt_ids: list[list[int]], n: int) -> torch.Tensor:
        self.history = [list(p) for p in prompt_ids for _ in range(n)]
        return self._encode()

    def feed(self, chunks: list[list[int]]) -> torch.Tensor:
        for row, chunk in zip(self.history, chunks):
            row += chunk
        if self.cache is None or max(len(c) for c in chunks) > 1:
            return self._encode()
        ids = torch.tensor([c[0] for c in chunks], device=self.device)[:, None]  # (R, 1)
        self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        out = self.model(
            input_ids=ids, attention_mask=self.mask, position_ids=self.next_pos[:, None],
            use_cache=True, **{self.cache_arg: self.cache},
        )
        self.cache, self.next_pos = getattr(out, self.cache_arg), self.next_pos + 1
        return out.logits[:, -1].float()

    def keep(self, rows: torch.Tensor) -> None:
        self.history = [self.history[i] for i in rows.tolist()]
        self.cache = None  # re-encoded at the next feed

    def _encode(self) -> torch.Tensor:
        ids, self.mask = left_pad(self.history, self.pad_id, self.device)  # (R, S)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True)
        self.cache, self.next_pos = getattr(out, self.cache_arg), self.mask.sum(-1)
        return out.logits[:, -1].float()
