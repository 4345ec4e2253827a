"""The native engine's `EpisodeModel`: each row's KV cache grows by the appended tokens only.

Notation: R rows held, L filled cache positions (shared by all rows, as in `KVCache`),
W chunk width, P the longest prompt, D head dim.

- start: the prompts are prefilled once each and their cache rows repeated n times
  (`NativeEngine._prefill`).
- feed: one forward of the R chunks, left-padded to W, at cache positions [L, L + W).
  `valid` (R, capacity) bool records which cache positions hold a real token of each
  row (prompt padding and chunk padding are False); it is the attention key mask of every
  later forward. Positions (RoPE) count real tokens only, so a row's logits are those of
  its unpadded sequence. A width-1 chunk (plain decoding) runs `native_decode.decode_step` on
  the call's `DecodeWeights`; a wider one (an environment answer) runs
  `BuiltinLM.hidden_states` with the cache, for the rows with an answer only (`_feed_wide`:
  most rows of a chunk feed one token, and running them W wide made these forwards 70%
  of the time), the others a decode step. Nothing before position L is recomputed.
- keep: the finished rows stay in the cache, fed nothing, until `compact_fraction` of the
  cache's rows have finished (as in `NativeEngine.generate`; None: until a pack for padding);
  then `cache.select` (compaction) of the rows still running, with the padding columns
  dropped (`packed_positions`). Compacting at every finished row copied the whole cache
  ~60 times per batch (40% of the time with 256 rows). All rows share L, so every chunk adds W columns to every
  row, and a row fed one token while another gets a 100-token answer gains 99 padding
  columns: left alone, L grew to 4x the longest row's real tokens (1277 vs ~330 in the
  calculator task), and every later attention and compaction paid for it. `feed` also
  packs once the padding passes `PACK_WASTE` of L. Dropping keys the mask hides changes no
  attention output (up to float summation order: sampled tokens stay the same).
- The cache grows by doubling (`KVCache.reserve`), since an episode's length is only
  bounded by the limits; RoPE's table covers P + max_total_tokens positions.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data.collate import left_pad
from posttrain.rollout.native_decode import DecodeWeights, decode_step

FIRST_ROOM = 64
"""Cache positions allocated after the prompt at the start; `_reserve` doubles from there."""

PACK_WASTE = 0.25
"""`feed` drops the padding columns (`_pack`) once even the row with the most real tokens has
more than this fraction of L as padding: a pack copies the cache once, about what one decode
step reads, and every later step reads the padding again."""


class NativeEpisodeModel:
    """KV-cache extension over a NativeEngine's model (module docstring); `engine` is the
    `native.NativeEngine` (its `_prefill`, `model` and `compact_fraction`)."""

    def __init__(self, engine: Any, pad_id: int, max_total_tokens: int, weights: DecodeWeights | None):
        self.engine, self.model, self.pad_id = engine, engine.model, pad_id
        self.max_total_tokens, self.weights = max_total_tokens, weights

    def start(self, prompt_ids: list[list[int]], n: int) -> torch.Tensor:
        room = max(len(p) for p in prompt_ids) + self.max_total_tokens + 1
        self.cache, logits, key_mask, self.next_pos = self.engine._prefill(prompt_ids, n, FIRST_ROOM, self.pad_id)
        rows, device = len(self.next_pos), self.model.device
        self.valid = torch.ones(rows, self.cache.max_len, dtype=torch.bool, device=device)
        if key_mask is not None:
            self.valid = key_mask[:, 0, 0].clone()
        self.valid[:, self.cache.length :] = False
        self.slot = torch.arange(rows, device=device)  # (R_held,) cache row of each held row
        positions = torch.arange(room, device=device)[None]
        self.cos, self.sin = (t[0] for t in self.model.model.rotary_emb(positions, self.model.dtype))
        return logits

    def feed(self, chunks: list[list[int]]) -> torch.Tensor:
        width, device = max(len(c) for c in chunks), self.model.device
        real = int(self.valid[self.slot, : self.cache.length].sum(-1).max())
        if self.cache.length - real > PACK_WASTE * self.cache.length:
            self._compact()
        length = self.cache.length
        self._reserve(length + width)
        padded = [[self.pad_id]] * self.cache.batch_size  # finished rows still held feed nothing
        for slot, chunk in zip(self.slot.tolist(), chunks):
            padded[slot] = chunk
        ids, chunk_mask = left_pad(padded, self.pad_id, device)  # (R, W)
        held = torch.zeros(len(ids), 1, dtype=chunk_mask.dtype, device=device)
        held[self.slot] = 1
        chunk_mask = chunk_mask * held
        self.valid[:, length : length + width] = chunk_mask.bool()
        if width == 1:
            pos = self.next_pos
            logits = decode_step(
                self.model, ids[:, 0], self.cos[pos][:, None], self.sin[pos][:, None],
                self.valid[:, None, None, : length + 1], self.cache, self.weights,
            )
        else:
            logits = self._feed_wide(ids, chunk_mask, length)
        self.next_pos = self.next_pos + chunk_mask.sum(-1)
        return logits[self.slot]

    def _feed_wide(self, ids: torch.Tensor, chunk_mask: torch.Tensor, length: int) -> torch.Tensor:
        """Chunks ids (R, W) left-padded (chunk_mask (R, W)) at cache positions [L, L + W) -> logits
        (R, V). Only the rows with more than one token (an answer) run the W-wide forward, on a
        copy of their cache rows put back after it; the others are a decode step of their one
        token at position L + W - 1 over zeros at [L, L + W - 1) (hidden, as any padding)."""
        width = ids.shape[1]
        wide = (chunk_mask.sum(-1) > 1).nonzero()[:, 0]  # (A,)
        pos = self.next_pos[:, None] + (chunk_mask.cumsum(-1) - 1).clamp(min=0)  # (R, W)
        mask = self.valid[:, : length + width].long()
        if len(wide) == len(ids):
            hidden = self.model.hidden_states(ids, mask, pos, self.cache)  # (R, W, H)
            return self.model.lm_head(hidden[:, -1])
        part = self.cache.take(wide)
        hidden = self.model.hidden_states(ids[wide], mask[wide], pos[wide], part)  # (A, W, H)
        self.cache.pad(width - 1)
        last = self.next_pos
        logits = decode_step(
            self.model, ids[:, -1], self.cos[last][:, None], self.sin[last][:, None],
            self.valid[:, None, None, : length + width], self.cache, self.weights,
        )  # (R, V); the wide rows' are replaced below
        self.cache.put(wide, part, length)
        logits[wide] = self.model.lm_head(hidden[:, -1])
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        """Finished rows stay in the cache (fed nothing) until `engine.compact_fraction` of its
        rows have finished (module docstring): a compaction copies the cache."""
        self.slot = self.slot[rows.to(self.model.device)]
        frac = self.engine.compact_fraction
        if frac is not None and self.cache.batch_size - len(self.slot) >= max(1, frac * self.cache.batch_size):
            self._compact()

    def _compact(self) -> None:
        """Drop the finished rows and the padding columns from the cache."""
        self._pack(self.slot)
        self.next_pos = self.next_pos[self.slot]
        self.slot = torch.arange(len(self.slot), device=self.slot.device)

    def _pack(self, rows: torch.Tensor) -> None:
        """Hold rows `rows` with their padding columns dropped (`packed_positions`)."""
        positions, valid = packed_positions(self.valid[rows, : self.cache.length])
        self.cache.select(rows, positions)
        self.valid = torch.zeros(len(rows), self.cache.max_len, dtype=torch.bool, device=valid.device)
        self.valid[:, : valid.shape[1]] = valid

    def _reserve(self, needed: int) -> None:
        if needed <= self.cache.max_len:
            return
        grown = max(needed, 2 * self.cache.max_len)
        self.cache.reserve(grown)
        extra = torch.zeros(len(self.valid), grown - self.valid.shape[1], dtype=torch.bool, device=self.valid.device)
        self.valid = torch.cat([self.valid, extra], dim=1)


def packed_positions(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache positions each row keeps when the padding columns are dropped.

    valid (R, L) bool, True = a real token -> positions (R, L') long and their valid
    (R, L') bool, L' the most real tokens of any row. A row's real positions keep their
    order and end at column L' - 1 (left padding, as after a prefill); a shorter row's
    first columns name padding positions, valid False. Attention over the kept keys is
    attention over the row's real keys, as before: masked keys add nothing."""
    width = int(valid.sum(-1).max()) if len(valid) else 0
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True)  # padding first, each in order
    return order.indices[:, valid.shape[1] - width :], order.values[:, valid.shape[1] - width :].bool()
