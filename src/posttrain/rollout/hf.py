"""The hf engine: transformers' `model.generate` for any causal LM.

Notation: B prompts, n samples per prompt, N = B·n rows, P the longest prompt,
W generated width, V vocab.

- Prompts are left-padded by hand (whatever the tokenizer's padding side) and each
  is repeated n times in a row, the grouping Completions promises (by hand too:
  `num_return_sequences` refuses n > 1 with greedy decoding).
- The GenerationConfig is built from SamplingParams alone: temperature, top-k,
  top-p, min-p and every other processor the checkpoint's generation_config.json
  might switch on (repetition penalty, ...) are set explicitly, so a checkpoint
  cannot change what is sampled.
- Stop strings and stop tokens are checked by a StoppingCriteria that applies the
  same rule as the other engines (`base.StopStrings`) to the response only;
  transformers' own `stop_strings` would also match across the prompt boundary.
- `on_tokens` (base.TokenCallback) is called from that StoppingCriteria, which sees
  every step's tokens: the rows that had not stopped before the step got one.
- Logprobs come from a teacher-forced forward of the same model over prompt +
  response after generation, through `posttrain.algos.token_logprobs` (the very
  function an RL trainer uses), in row chunks of bounded size. `output_logits`
  would keep W x N x V floats alive (tens of GB for a 150k vocabulary).
- `seed` seeds torch's global RNG inside `torch.random.fork_rng`: `generate`
  samples with torch.multinomial on the global generator, and the caller's RNG
  state is restored afterwards.
- `seed_mode="row"` (`SamplingParams`): `generate` runs greedy over the scores of
  `_RowSampler`, a logits processor that picks each row's token as the other engines'
  row mode does (`sampling.sample_next` on `row_uniforms(seed, first_row + row, step)`; a resumed
  generation's rows and positions as `SamplingParams.draw_rows` and `first_position` say) and
  leaves it the only finite score, so the tokens are the native engine's for the same
  logits, and a batch generated in slices is the whole batch's.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from posttrain.algos import token_logprobs
from posttrain.data.collate import left_pad, pad_id_of
from posttrain.models import forward_logits
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
from posttrain.rollout.sampling import resolve_seed, row_uniforms, sample_next, stream_seed

# Most float32 logits (rows x tokens x vocab) alive at once in the logprob forward.
_LOGPROB_CHUNK_ELEMENTS = 1 << 26


class HFEngine(PlaysEpisodes, HoldsNoDeviceMemory):
    """Sampling through `model.generate` (module docstring)."""

    kind = "hf"
    """The name `make_engine` knows it by."""

    def __init__(self, model: nn.Module, tokenizer):
        """model: a transformers causal LM (peft-wrapped or not); tokenizer: its tokenizer."""
        self.tokenizer = tokenizer
        self.sync_weights(model)

    def sync_weights(self, model: nn.Module) -> None:
        """Point the engine at `model` (generate reads its live weights)."""
        if not hasattr(model, "generate"):
            raise ValueError(
                f"rollout.engine=hf runs transformers' generate, which this {type(model).__name__} lacks "
                "(the built-in model): load the model with transformers (model.impl=hf; model.impl=auto "
                "does so under rollout.engine=hf), or set rollout.engine=native or auto (--engine native "
                "on the command line)"
            )
        self.model = model

    def generate(
        self, prompts: Prompts, params: SamplingParams, on_tokens: TokenCallback | None = None
    ) -> Completions:
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        rows = [p for p in prompt_ids for _ in range(params.n)]
        pad_id = pad_id_of(self.tokenizer)
        device = next(self.model.parameters()).device
        ids, mask = left_pad(rows, pad_id, device)  # (N, P)
        stop_ids = params.resolved_stop_token_ids(self.tokenizer)
        criteria = _StopCriteria(ids.shape[1], stop_ids, StopStrings(self.tokenizer, params.stop), on_tokens)
        seed = resolve_seed(params.seed)
        row_mode = params.seed_mode == "row" and not params.greedy
        processors = LogitsProcessorList([_RowSampler(params, seed, ids.shape[1])] if row_mode else [])
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            with torch.inference_mode(), _seeded(stream_seed(seed, params.first_position), device):
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=_generation_config(params, stop_ids, pad_id, greedy=row_mode),
                    stopping_criteria=StoppingCriteriaList([criteria]),
                    logits_processor=processors,
                )
            responses = out[:, ids.shape[1] :].cpu()  # (N, W)
            lengths, stopped = criteria.finish(responses.shape[1])
            logprobs = None
            if params.logprobs:
                logprobs = self._logprobs(rows, responses, lengths, params.logprob_temperature)
        finally:
            self.model.train(was_training)
        return build_completions(
            prompt_ids=rows,
            response_ids=responses,
            lengths=lengths,
            stopped=stopped,
            logprobs=logprobs,
            params=params,
            tokenizer=self.tokenizer,
            pad_id=pad_id,
            meta={
                "engine": "hf",
                "decode_steps": responses.shape[1],
                "seconds": time.perf_counter() - start,
            },
        )

    def advance(self, play: EpisodePlay, tokens: int | None = None, version: int = 0) -> bool:
        """Play on (`episodes.EpisodePlay.run`) with the model's weights now, re-encoding histories
        after answers (`hf_episodes`)."""
        from posttrain.rollout.hf_episodes import HFEpisodeModel

        with eval_inference(self.model):
            return play.run(HFEpisodeModel(self.model, play.pad_id), tokens, version)

    @torch.inference_mode()
    def _logprobs(
        self,
        prompt_ids: list[list[int]],
        responses: torch.Tensor,
        lengths: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        """(N, W) float32 logprobs of the responses by a teacher-forced forward.

        Each row is prompt + response packed to the left and right-padded, so positions
        are 0, 1, ... as during generation (left padding there is masked out and its
        positions derived from the mask).
        """
        rows, width = responses.shape
        device = next(self.model.parameters()).device
        out = torch.zeros(rows, width, dtype=torch.float32)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        total = max(len(p) for p in prompt_ids) + width
        step = max(1, _LOGPROB_CHUNK_ELEMENTS // (total * vocab))
        for first in range(0, rows, step):
            chunk = range(first, min(rows, first + step))
            seqs = [prompt_ids[r] + responses[r, : int(lengths[r])].tolist() for r in chunk]
            seq_len = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), seq_len, dtype=torch.long)
            labels = torch.full((len(seqs), seq_len), -100, dtype=torch.long)
            mask = torch.zeros(len(seqs), seq_len, dtype=torch.long)
            for i, (r, s) in enumerate(zip(chunk, seqs)):
                ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
                labels[i, len(prompt_ids[r]) : len(s)] = ids[i, len(prompt_ids[r]) : len(s)]
            positions = torch.arange(seq_len)[None].expand(len(seqs), -1)
            logits = forward_logits(
                self.model, ids.to(device), mask.to(device), positions.to(device)
            )
            logp = token_logprobs(logits[:, :-1], labels[:, 1:].to(device), temperature).cpu()
            for i, r in enumerate(chunk):
                p, n_resp = len(prompt_ids[r]), int(lengths[r])
                out[r, :n_resp] = logp[i, p - 1 : p - 1 + n_resp]
        return out


class _StopCriteria(StoppingCriteria):
    """transformers StoppingCriteria: a row is done when its newest token is a stop token
    or completes a stop string in the response (the tokens after the P prompt columns).
    It records where each row stopped, so the output needs no second scan, and hands each
    step's tokens of the rows still running to `on_tokens`."""

    def __init__(
        self, prompt_width: int, stop_ids, stops: StopStrings, on_tokens: TokenCallback | None = None
    ):
        self.prompt_width, self.stops, self.on_tokens = prompt_width, stops, on_tokens
        self.stop_ids = torch.tensor(list(stop_ids), dtype=torch.long)
        self.stop_at: list[int | None] = []  # per row: index of its stopping token
        self.texts: list[list[int]] = []  # per row: response so far (stop strings only)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width - 1  # index of the newest token
        newest = input_ids[:, -1]
        if not self.stop_at:
            self.stop_at = [None] * len(newest)
            self.texts = [[] for _ in newest]
        hits = torch.isin(newest, self.stop_ids.to(newest.device)).tolist()
        fresh: tuple[list[int], list[int]] = ([], [])
        for row, (tok, hit) in enumerate(zip(newest.tolist(), hits)):
            if self.stop_at[row] is not None:
                continue
            fresh[0].append(row)
            fresh[1].append(tok)
            if self.stops:
                self.texts[row].append(tok)
                hit = hit or self.stops.completes(self.texts[row])
            if hit:
                self.stop_at[row] = step
        if self.on_tokens is not None and fresh[0]:
            self.on_tokens(*fresh)
        done = [s is not None for s in self.stop_at]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def finish(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row length (N,) and stopped flag (N,) for generate's `width` new columns;
        rows that never stopped inside them ran the full width. (A stop seen in a step
        that generate undid, as its deferred stop check on "mps" does, is ignored.)"""
        at = [s if s is not None and s < width else None for s in self.stop_at]
        lengths = [width if s is None else s + 1 for s in at]
        stopped = [s is not None for s in at]
        return torch.tensor(lengths, dtype=torch.long), torch.tensor(stopped, dtype=torch.bool)


class _RowSampler(LogitsProcessor):
    """Row mode (module docstring): scores (N, V) of the rows of a `generate` call whose
    prompts are `prompt_width` wide -> scores that are 0 on each row's sampled token and -inf
    elsewhere, for greedy decoding to pick it."""

    def __init__(self, params: SamplingParams, seed: int, prompt_width: int):
        self.params, self.seed, self.prompt_width = params, seed, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width  # index of the token being sampled
        rows = self.params.draw_rows(torch.arange(len(scores), device=scores.device))
        position = self.params.first_position + step
        tokens, _ = sample_next(scores, self.params, uniform=row_uniforms(self.seed, rows, position))
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


def _generation_config(params: SamplingParams, stop_ids, pad_id: int, greedy: bool = False) -> GenerationConfig:
    """transformers' settings for `params`; greedy: argmax decoding whatever the temperature
    (row mode samples in its logits processor)."""
    sampling = {}
    greedy = greedy or params.greedy
    if not greedy:
        sampling = dict(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p or None,
        )
    return GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        do_sample=not greedy,
        num_beams=1,
        # Stopped rows are padded from here on; [] disables the checkpoint's eos.
        eos_token_id=list(stop_ids),
        pad_token_id=pad_id,
        # Neutralise processors a checkpoint's generation_config.json may enable.
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        min_new_tokens=0,
        **sampling,
    )


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
