"""The native engine: batched KV-cache decoding of a BuiltinLM, in eager PyTorch.

Notation: B prompts in a chunk, n samples per prompt, R = B·n rows, P the longest
prompt, S = max_new_tokens, V vocab, D head dim.

One `generate` chunk:
  1. prefill: the B prompts, left-padded to P, in one forward into a KV cache sized
     P + S; only the last position goes through lm_head. The cache rows are then
     repeated n times (`cache.select`), so a prompt is prefilled once, not n times.
  2. decode: one token per step for every row still in the batch. The step skips the
     per-call work of `BuiltinLM.forward`: the RoPE cos/sin table is computed once
     for positions 0 .. P+S-1 and indexed per step, and the (R, 1, 1, P+S) key mask
     is built once (prompt padding) and sliced per step. Each decoder layer runs as
     `DecoderLayer` does (its norms, `grouped_attention`, the same arithmetic) on
     weights laid out once per `generate` call (`DecodeWeights`, a copy of the linear
     weights held for the call: memory for the weights twice): q/k/v stacked into
     one matmul, gate/up into another, every matrix stored (in, out) so that x @ W is
     a plain row-major product (10-20% faster than nn.Linear's x @ Wᵀ at these sizes
     on the CPU; the same sums), and RoPE applied to q and k together as
     x·cos + roll(x, D/2)·sin± (rotate_half(x)·sin with the sign moved into sin: the
     same products). A model whose projections are not plain `nn.Linear` (LoRA
     adapters injected) runs its layers as modules.
  3. compaction: finished rows keep costing a full decode step until they are
     dropped with `cache.select` (a copy of the cache's filled positions). The engine
     drops them when at least `compact_fraction` of the rows in the batch have
     finished (default 1/4; benchmarks/rollout.py measures the choice), and stops as
     soon as every row has finished.

`on_tokens` (see `base.TokenCallback`) hears every step's tokens of the rows still
alive, numbered as the output rows, as soon as they are sampled.

Sampling (`sampling.Draws`, `SamplingParams.seed_mode`): in "batch" mode (the default) noise
is drawn for all R rows of the chunk every step from one torch.Generator seeded per
call, and each row reads its own noise row, so a row's sample does not depend on
compaction (tests check outputs are identical with and without it). They are the draws
torch.multinomial makes, so on the CPU the native and hf engines sample the same tokens
for the same seed (a test pins this). In "row" mode row i's draw at step t is
`row_uniforms(seed, first_row + i, t)`: a batch generated in slices samples the whole
batch's tokens (and the hf engine's, for the same logits). Greedy decoding matches
transformers' `generate` token for token.

Models: a BuiltinLM (also peft-wrapped), or a transformers Llama, Qwen2, Qwen3 or Mistral
causal LM whose features BuiltinLM implements, which is viewed as a BuiltinLM sharing the
same parameter tensors (no copy). Qwen2's q/k/v bias is stacked like the weights; Qwen3's
q_norm / k_norm run on the step's q and k heads before RoPE, as in `Attention`.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from posttrain.data.collate import left_pad, pad_id_of
from posttrain.models import BuiltinConfig, BuiltinLM
from posttrain.models import llama_checkpoint as ckpt
from posttrain.rollout.base import (
    Completions,
    HoldsNoDeviceMemory,
    Prompts,
    SamplingParams,
    StopStrings,
    TokenCallback,
    build_completions,
    encode_prompts,
    eval_inference,
)
from posttrain.rollout.episodes import EpisodePlay, PlaysEpisodes
from posttrain.rollout.native_decode import DecodeWeights, decode_step
from posttrain.rollout.native_episodes import NativeEpisodeModel
from posttrain.rollout.sampling import Draws


def native_problems(model: nn.Module) -> list[str]:
    """Why the native engine cannot run `model` (empty: it can). It runs a BuiltinLM (peft-wrapped
    or not) and transformers models of a family BuiltinLM implements (`ckpt.unsupported_features`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(base, BuiltinLM):
        return []
    config = getattr(base, "config", None)
    if not hasattr(config, "to_dict"):
        return [f"{type(base).__name__} is not a transformers model"]
    return ckpt.unsupported_features(config.to_dict())


def native_refusal(what: str, problems: list[str]) -> str:
    """The error message for a model the native engine cannot run, in config keys."""
    return (
        f"rollout.engine=native cannot run {what}: {'; '.join(problems)}. The native engine runs the "
        f"built-in decoder ({', '.join(ckpt.ARCHITECTURES)} checkpoints); set rollout.engine=hf "
        "(transformers' generate, any causal LM) or auto; on the command line of generate, eval "
        "and serve: --engine hf"
    )


def as_builtin(model: nn.Module) -> BuiltinLM:
    """The BuiltinLM that computes `model`'s logits, sharing its parameters.

    BuiltinLM -> itself; peft model -> its (adapter-injected) base model; transformers
    Llama/Qwen2/Qwen3/Mistral model -> a BuiltinLM whose parameters are the HF model's tensors.
    Raises ValueError (`native_refusal`) for any other model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(base, BuiltinLM):
        return base
    problems = native_problems(base)
    if problems:
        raise ValueError(native_refusal(f"this {type(base).__name__}", problems))
    with torch.device("meta"):
        view = BuiltinLM(BuiltinConfig(**ckpt.builtin_fields(base.config.to_dict())))
    state = dict(base.state_dict())
    if view.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    view.load_state_dict(state, strict=False, assign=True)  # assign: share, do not copy
    view.tie_weights()
    view.model.rotary_emb.reset_inv_freq(view.device)
    return view.eval()


class NativeEngine(PlaysEpisodes, HoldsNoDeviceMemory):
    """Batched KV-cache sampling from a BuiltinLM (module docstring)."""

    kind = "native"
    """The name `make_engine` knows it by."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        compact_fraction: float | None = 0.25,
        max_batch_size: int | None = None,
    ):
        """
        Args:
            model: BuiltinLM, peft-wrapped BuiltinLM, or a transformers Llama, Qwen2, Qwen3
                or Mistral causal LM (`native_problems` says why another cannot run).
            tokenizer: encodes string prompts, decodes texts, gives eos/pad ids.
            compact_fraction: drop finished rows from the decode batch once this
                fraction of its rows has finished; None never drops them (tests).
            max_batch_size: most rows (prompts x n) decoded together; larger calls
                run in chunks of whole prompts. None = all rows at once.
        """
        if compact_fraction is not None and not 0 <= compact_fraction <= 1:
            raise ValueError(f"compact_fraction must be in [0, 1] or None, got {compact_fraction}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.tokenizer = tokenizer
        self.compact_fraction = compact_fraction
        self.max_batch_size = max_batch_size
        self.sync_weights(model)

    def sync_weights(self, model: nn.Module) -> None:
        """Point the engine at `model` (weights are shared, so nothing is copied)."""
        self.model = as_builtin(model)

    def generate(
        self, prompts: Prompts, params: SamplingParams, on_tokens: TokenCallback | None = None
    ) -> Completions:
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        pad_id = pad_id_of(self.tokenizer)
        per_chunk = max(1, (self.max_batch_size or len(prompt_ids) * params.n) // params.n)
        draws = Draws(params, self.model.device)
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        parts, steps, compactions = [], 0, 0
        try:
            with torch.inference_mode():
                weights = DecodeWeights.of(self.model)  # the weights do not change during the call
                for first in range(0, len(prompt_ids), per_chunk):
                    chunk = prompt_ids[first : first + per_chunk]
                    part = self._generate_chunk(
                        chunk, params, draws, pad_id, weights, on_tokens, first * params.n
                    )
                    steps += part.pop("steps")
                    compactions += part.pop("compactions")
                    parts.append(part)
        finally:
            self.model.train(was_training)
        return build_completions(
            prompt_ids=[p for p in prompt_ids for _ in range(params.n)],
            response_ids=torch.cat([p["tokens"] for p in parts]),  # (N, S) each chunk
            lengths=torch.cat([p["lengths"] for p in parts]),
            stopped=torch.cat([p["stopped"] for p in parts]),
            logprobs=torch.cat([p["logprobs"] for p in parts]),
            params=params,
            tokenizer=self.tokenizer,
            pad_id=pad_id,
            meta={
                "engine": "native",
                "decode_steps": steps,
                "compactions": compactions,
                "seconds": time.perf_counter() - start,
            },
        )

    def advance(self, play: EpisodePlay, tokens: int | None = None, version: int = 0) -> bool:
        """Play on (`episodes.EpisodePlay.run`) with the engine's weights now; each row's KV cache
        grows by the appended tokens only (`native_episodes`), a cache of its own per call. All
        rows run at once (`max_batch_size` does not apply)."""
        with eval_inference(self.model):
            model = NativeEpisodeModel(self, play.pad_id, play.limits.max_total_tokens, DecodeWeights.of(self.model))
            return play.run(model, tokens, version)

    def _prefill(self, prompt_ids: list[list[int]], n: int, max_new: int, pad_id: int):
        """Prompts through the model once, cache rows repeated n times.

        Returns the cache (R rows, room for P + S positions), next-token logits (R, V),
        the key mask (R, 1, 1, P+S) bool (True = may attend; None without padding) and
        the position of each row's first generated token (R,).
        """
        model, device = self.model, self.model.device
        ids, mask = left_pad(prompt_ids, pad_id, device)  # (B, P)
        width, total = ids.shape[1], ids.shape[1] + max_new
        cache = model.new_cache(len(prompt_ids), total)
        padded = not bool(mask.all())
        hidden = model.hidden_states(ids, mask if padded else None, cache=cache)[:, -1]  # (B, H)
        expand = torch.arange(len(prompt_ids), device=device).repeat_interleave(n)  # (R,)
        if n > 1:
            cache.select(expand)
        key_mask = None
        if padded:
            key_mask = torch.ones(len(expand), 1, 1, total, dtype=torch.bool, device=device)
            key_mask[:, 0, 0, :width] = mask[expand].bool()
        return cache, model.lm_head(hidden)[expand], key_mask, mask.sum(-1)[expand]

    def _generate_chunk(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        draws: Draws,
        pad_id: int,
        weights: DecodeWeights | None,
        on_tokens: TokenCallback | None = None,
        row_offset: int = 0,
    ) -> dict:
        """Sample n completions of each prompt: per-row tokens/logprobs (R, S), lengths, stopped.
        `on_tokens` hears each step's tokens, rows numbered from `row_offset` (the chunk's first)."""
        model, device = self.model, self.model.device
        max_new, rows = params.max_new_tokens, len(prompt_ids) * params.n
        cache, logits, key_mask, next_pos = self._prefill(prompt_ids, params.n, max_new, pad_id)
        positions = torch.arange(cache.max_len, device=device)[None]  # RoPE table, once
        cos_table, sin_table = (t[0] for t in model.model.rotary_emb(positions, model.dtype))
        stop_ids = torch.tensor(
            params.resolved_stop_token_ids(self.tokenizer), dtype=torch.long, device=device
        )
        stops = StopStrings(self.tokenizer, params.stop)
        texts: list[list[int]] = [[] for _ in range(rows)]  # tokens so far, for stop strings

        tokens = torch.full((rows, max_new), pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        row_ids = torch.arange(rows, device=device)  # global row of each batch row
        alive = torch.ones(rows, dtype=torch.bool, device=device)  # per batch row
        step = compactions = 0
        for step in range(max_new):
            # batch mode draws for all rows: a row's sample ignores compaction
            tok, logp = draws.sample(logits, row_ids, rows, step, row_offset)  # (R_cur,)
            tokens[row_ids, step] = torch.where(alive, tok, pad_id)
            logprobs[row_ids, step] = torch.where(alive, logp, 0.0)
            lengths[row_ids] += alive
            if on_tokens is not None:
                live = alive.nonzero()[:, 0]
                on_tokens((row_ids[live] + row_offset).tolist(), tok[live].tolist())
            hit = alive & torch.isin(tok, stop_ids)
            if stops:
                hit |= _stop_string_hits(stops, texts, row_ids, alive, tok)
            stopped[row_ids] |= hit
            alive &= ~hit
            alive_count = int(alive.sum())
            if alive_count == 0 or step == max_new - 1:
                break
            finished = len(alive) - alive_count
            frac = self.compact_fraction
            if frac is not None and finished >= max(1, frac * len(alive)):
                keep = alive.nonzero()[:, 0]
                cache.select(keep)
                compactions += 1
                row_ids, alive, tok, next_pos = (
                    row_ids[keep],
                    alive[keep],
                    tok[keep],
                    next_pos[keep],
                )
                key_mask = None if key_mask is None else key_mask[keep]
            pos = next_pos + step  # (R_cur,) position of the token fed now
            step_mask = None if key_mask is None else key_mask[..., : cache.length + 1]
            logits = decode_step(
                model, tok, cos_table[pos][:, None], sin_table[pos][:, None], step_mask, cache, weights
            )
        return {
            "tokens": tokens.cpu(),
            "logprobs": logprobs.cpu(),
            "lengths": lengths.cpu(),
            "stopped": stopped.cpu(),
            "steps": step + 1,
            "compactions": compactions,
        }


def _stop_string_hits(
    stops: StopStrings,
    texts: list[list[int]],
    row_ids: torch.Tensor,
    alive: torch.Tensor,
    tok: torch.Tensor,
) -> torch.Tensor:
    """(R_cur,) bool: rows whose newest token completes a stop string (appends it to texts)."""
    hits = []
    for row, live, t in zip(row_ids.tolist(), alive.tolist(), tok.tolist()):
        if live:
            texts[row].append(t)
        hits.append(live and stops.completes(texts[row]))
    return torch.tensor(hits, dtype=torch.bool, device=alive.device)
