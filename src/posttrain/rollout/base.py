"""What every rollout engine shares: SamplingParams, Completions, the engine protocol and
stop handling (next-token sampling: `rollout/sampling.py`).

Notation: B prompts, n samples per prompt, N = B·n rows, T_resp the longest
response in a batch, V vocab.

Log-probabilities (`Completions.logprobs`) are those of the *temperature-scaled*
distribution, before top-k / top-p / min-p filtering:

    logp_t = log softmax(logits_t / temperature)[y_t]        (temperature 0 -> 1)

which is exactly `posttrain.algos.token_logprobs(logits, labels, temperature)` of a
teacher-forced forward over the same tokens, so an RL trainer may use them as
`old_logp` when it scores with the same temperature (tests/rollout check the match
to 1e-4 in fp32). The filters only decide which tokens may be sampled; they do not
renormalise the logprob. This is veRL's convention (its actor recomputes
log softmax(logits / T) over the full vocabulary); vLLM's `processed_logprobs`
equals it only while no filter is active (see `vllm.py`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from posttrain.config.rollout import RolloutConfig

Prompts = Sequence[str] | Sequence[Sequence[int]]
"""A batch of prompts: strings (tokenized by the engine, BOS as the tokenizer adds it)
or token-id lists (used as they are)."""

FINISH_REASONS = ("stop", "length")

SEED_MODES = ("batch", "row")
"""The values of `SamplingParams.seed_mode` (config key `rollout.seed_mode`)."""

TokenCallback = Callable[[list[int], list[int]], None]
"""`on_tokens(rows, token_ids)`, which `generate` calls after each decode step: the rows
(indices into the call's output rows, grouped by prompt) that got a token in that step,
and those tokens, stop tokens included. It runs on the generating thread and must be
quick. `TextStream` turns one row's tokens into the text `Completions.texts` will hold."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one call's completions (names as in vLLM, where they exist)."""

    n: int = 1
    """Samples per prompt. Output rows are grouped by prompt: p0 x n, p1 x n, ... (GRPO groups)."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most probable tokens whose mass first reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep the k most probable tokens (ties at the k-th kept); 0 = off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the top token's probability (0 = off)."""
    max_new_tokens: int = 256
    """Most tokens generated per row; a row that reaches it finishes with reason "length"."""
    stop: tuple[str, ...] = ()
    """Stop strings: a row finishes (reason "stop") with the token that completes one of
    them in its decoded response; that token is kept in `response_ids`."""
    stop_token_ids: tuple[int, ...] | None = None
    """Token ids that finish a row (reason "stop") and are kept as its last token.
    None = the tokenizer's eos token; () = never stop on a token (benchmarks)."""
    include_stop_str_in_output: bool = False
    """Whether `Completions.texts` keeps the matched stop string (as in vLLM)."""
    seed: int | None = None
    """Same seed, same prompts, same engine -> same samples. None draws one from torch's
    global RNG, so `torch.manual_seed` still makes a run repeatable."""
    logprobs: bool = True
    """Return `Completions.logprobs` (see the module docstring for their definition)."""
    seed_mode: str = "batch"
    """How a call's randomness is drawn (`Draws`). "batch": one random stream for the call
    (Exp(1) noise for all its rows every step), so a row's samples depend on the rows it is
    generated with. "row": row i's draw at position t is a function of (seed, first_row + i, t)
    alone, so a batch generated in slices (each given the index of its first row) samples the
    tokens of the whole batch, given the same logits: what lets generation split over workers."""
    first_row: int = 0
    """seed_mode "row": the index, in the whole batch, of this call's first output row (a slice
    of rows [k, k + N) passes k). Must be 0 with seed_mode "batch"."""
    row_index: tuple[int, ...] | None = None
    """seed_mode "row": each output row's index in the whole batch, when the rows are not
    consecutive (a generation resumed for its unfinished rows only); the call's rows are then
    row_index[first_row + i]. None: first_row + i."""
    first_position: int = 0
    """The index of each row's first generated token in its response: a generation resumed
    after that many tokens (`trainers.rl_partial`). Row mode draws token t with position
    first_position + t, as the unsegmented call would; batch mode seeds its stream with
    (seed, first_position), so a segment does not reuse the draws of the first."""

    def __post_init__(self) -> None:
        # Accept lists from configs and callers; store tuples so params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = {
            "n": self.n >= 1,
            "temperature": self.temperature >= 0 and math.isfinite(self.temperature),
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "min_p": 0 <= self.min_p <= 1,
            "max_new_tokens": self.max_new_tokens >= 1,
            "seed_mode": self.seed_mode in SEED_MODES,
            "first_row": self.first_row >= 0 and (self.seed_mode == "row" or self.first_row == 0),
            "row_index": self.row_index is None or self.seed_mode == "row",
            "first_position": self.first_position >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is out of range")
        if self.row_index is not None:
            object.__setattr__(self, "row_index", tuple(int(r) for r in self.row_index))
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain an empty string")

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> SamplingParams:
        """The params of an RL `rollout` config section: each of its fields but the engine
        options (`ROLLOUT_ENGINE_OPTIONS`) under the same name; the rest keep their defaults.
        A sampling field RolloutConfig gains and SamplingParams lacks is a TypeError here."""
        from posttrain.config.rollout import ROLLOUT_ENGINE_OPTIONS

        names = [f.name for f in fields(rollout) if f.name not in ROLLOUT_ENGINE_OPTIONS]
        return cls(**{name: getattr(rollout, name) for name in names})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution whose logprobs are returned (1 when greedy)."""
        return self.temperature if self.temperature > 0 else 1.0

    def draw_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(R,) long: the whole batch's row index of the call's output rows `rows` (row mode)."""
        idx = rows.long() + self.first_row
        if self.row_index is None:
            return idx
        return torch.tensor(self.row_index, dtype=torch.long, device=idx.device)[idx]

    def resolved_stop_token_ids(self, tokenizer) -> tuple[int, ...]:
        if self.stop_token_ids is not None:
            return self.stop_token_ids
        eos = getattr(tokenizer, "eos_token_id", None)
        return () if eos is None else (int(eos),)


class SampledRows:
    """What Completions and Episodes both answer from their `prompt_ids` (N rows) and `lengths`
    ((N,) sampled tokens per row): the row count and the sampled-token count."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the model sampled over all rows (what throughput counts; an episode's
        environment tokens are not among them)."""
        return int(self.lengths.sum())


@dataclass
class Completions(SampledRows):
    """One call's output, N = B·n rows grouped by prompt (rows i·n .. i·n+n-1 answer prompt i).

    Tensors are on the CPU. Padding positions hold `pad_token_id` in `response_ids`
    and 0 in `response_mask` and `logprobs`.
    """

    prompt_ids: list[list[int]]
    """N token lists: the prompt of each row, unpadded (as tokenized, BOS included)."""
    prompt_index: torch.Tensor
    """(N,) long: which input prompt each row answers (0,0,..,1,1,.. for n > 1)."""
    response_ids: torch.Tensor
    """(N, T_resp) long: generated tokens, right-padded with `pad_token_id`. A row that
    finished on a stop token or stop string keeps that token as its last one."""
    response_mask: torch.Tensor
    """(N, T_resp) long: 1 on generated tokens (the stop token included), 0 on padding."""
    logprobs: torch.Tensor | None
    """(N, T_resp) float32: log softmax(logits / T)[token] of each generated token, with
    T = temperature (1 when greedy), over the full vocabulary before top-k/top-p/min-p
    filtering; 0 on padding. None when `SamplingParams.logprobs` is False."""
    lengths: torch.Tensor
    """(N,) long: generated tokens per row = response_mask.sum(-1)."""
    finish_reason: list[str]
    """N strings: "stop" (a stop token or stop string ended the row) or "length"
    (max_new_tokens reached)."""
    texts: list[str]
    """N strings: the response decoded with special tokens skipped, without its final stop
    token, and cut before the matched stop string (kept if include_stop_str_in_output)."""
    pad_token_id: int = 0
    """The id used to pad `response_ids`."""
    meta: dict = field(default_factory=dict)
    """Engine facts for logging, e.g. {"engine": "native", "decode_steps": 37}."""



@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop calls: `generate` for rollouts, `offload` before each update,
    `resume` and `sync_weights` after it."""

    tokenizer: object

    def generate(
        self, prompts: Prompts, params: SamplingParams, on_tokens: TokenCallback | None = None
    ) -> Completions:
        """Sample `params.n` completions of every prompt (rows grouped by prompt); `on_tokens`
        hears each step's new tokens while decoding (vllm: replayed after the call)."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the next `generate` sample from `model`'s current weights."""
        ...

    def offload(self) -> None:
        """Give the GPU memory the engine holds to the update (vllm: sleep; others: nothing)."""
        ...

    def resume(self) -> None:
        """Take back what `offload` gave (vllm: wake up; others: nothing)."""
        ...


class HoldsNoDeviceMemory:
    """`offload`/`resume` of an engine with no device memory of its own between calls (native,
    hf: the policy's weights are shared) or none in this process (a vLLM server's)."""

    def offload(self) -> None:
        """Nothing to free."""

    def resume(self) -> None:
        """Nothing to take back."""


def encode_prompts(tokenizer, prompts: Prompts) -> list[list[int]]:
    """Strings -> token ids with the tokenizer's special tokens (BOS); id lists pass through."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings or of token-id lists, not one string")
    out = []
    for i, p in enumerate(prompts):
        ids = tokenizer(p)["input_ids"] if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")
        out.append(ids)
    return out


# ---------------------------------------------------------------- stop handling


class StopStrings:
    """Detects, token by token, when a decoded response completes a stop string.

    A stop string counts when it occurs in the decoded response (special tokens
    skipped) and ends inside the characters the newest token added: the rule of
    transformers' StopStringCriteria and of vLLM's detokenizer. Only a window of
    recent tokens is decoded, long enough to hold the longest stop string even at
    four byte-level tokens per character.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def completes(self, ids: Sequence[int]) -> bool:
        """Does the last token of `ids` (a response so far) complete a stop string?"""
        if not self.stops or not ids:
            return False
        tail = ids[-self.window :]
        text, before = self._decode(tail), self._decode(tail[:-1])
        new_from = _common_prefix_len(before, text)  # the newest token's characters start here
        return any(text.find(s, max(0, new_from - len(s) + 1)) != -1 for s in self.stops)

    def cut(self, text: str, keep: bool) -> str:
        """`text` up to the first stop string (through it when keep); unchanged if none."""
        hits = [(i, s) for s in self.stops if (i := text.find(s)) != -1]
        if not hits:
            return text
        start, stop = min(hits)
        return text[: start + len(stop)] if keep else text[:start]


class TextStream:
    """One row's text as its tokens arrive (streaming), pieces that only ever extend it.

    `push(token)` returns the new text that is final: the response so far decoded as
    `build_completions` decodes it (special tokens skipped, cut before a stop string),
    holding back what may still change: a trailing partial UTF-8 character (U+FFFD, as
    byte-level tokens decode mid-character), trailing whitespace (tokenizer clean-up may
    remove it: " ." becomes "."), and a tail that may be the start of a stop string. A
    stop token adds nothing. `finish(text)` gives the rest of the row's final text, so
    the pieces always join to exactly `Completions.texts[row]`. Each push decodes the
    whole prefix: O(T²) decoded tokens per row, fine for a server's replies.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.stop_ids = set(params.resolved_stop_token_ids(tokenizer))
        self.stops = StopStrings(tokenizer, params.stop)
        self.keep_stop = params.include_stop_str_in_output
        self.ids: list[int] = []
        self.sent = ""
        self.ended = False

    def push(self, token: int) -> str:
        if self.ended:
            return ""
        if token in self.stop_ids:
            self.ended = True
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self.stops.cut(text, self.keep_stop)
        if cut != text:  # a stop string: the row ends here
            self.ended = True
            safe = cut
        else:
            safe = _without_partial_stop(text.rstrip("\ufffd"), self.stops.stops).rstrip()
        if not safe.startswith(self.sent):  # decoding changed earlier text; wait for it to settle
            return ""
        new, self.sent = safe[len(self.sent) :], safe
        return new

    def finish(self, text: str) -> str:
        """What is left of the row's final `text` after the pieces already returned."""
        if not text.startswith(self.sent):  # cannot happen with the rules above; say so if it does
            import logging

            logging.getLogger(__name__).warning(
                "streamed text %r is not a prefix of the final text %r", self.sent, text
            )
            return ""
        rest, self.sent = text[len(self.sent) :], text
        return rest


def _without_partial_stop(text: str, stops: Sequence[str]) -> str:
    """`text` without its longest tail that is a proper prefix of a stop string."""
    cut = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), cut, -1):
            if text.endswith(s[:k]):
                cut = k
                break
    return text[: len(text) - cut]


def replay_tokens(on_tokens: TokenCallback, response_ids: torch.Tensor, lengths: torch.Tensor) -> None:
    """Call `on_tokens` step by step over finished responses (N, W) valid up to `lengths` (N,),
    for an engine that cannot report tokens while it decodes."""
    lengths_list = lengths.tolist()
    for step in range(response_ids.shape[1] if len(lengths_list) else 0):
        rows = [r for r, n in enumerate(lengths_list) if n > step]
        if not rows:
            break
        on_tokens(rows, response_ids[rows, step].tolist())


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---------------------------------------------------------------- assembling the output


def build_completions(
    prompt_ids: list[list[int]],
    response_ids: torch.Tensor,
    lengths: torch.Tensor,
    stopped: torch.Tensor,
    logprobs: torch.Tensor | None,
    params: SamplingParams,
    tokenizer,
    pad_id: int,
    meta: dict | None = None,
) -> Completions:
    """Assemble a Completions from per-row results of any engine.

    prompt_ids: N prompts (already repeated n times); response_ids (N, W) long, valid
    up to `lengths` (N,); stopped (N,) bool, True when a stop token or stop string ended
    the row; logprobs (N, W) float or None. Everything past a row's length is reset to
    padding, and the width is trimmed to the longest row.
    """
    response_ids, lengths = response_ids.cpu(), lengths.cpu().long()
    width = int(lengths.max()) if len(lengths) else 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # (N, T_resp)
    response_ids = response_ids[:, :width].masked_fill(mask == 0, pad_id)
    if logprobs is not None:
        logprobs = logprobs.cpu().float()[:, :width].masked_fill(mask == 0, 0.0)
    stop_ids = set(params.resolved_stop_token_ids(tokenizer))
    stops = StopStrings(tokenizer, params.stop)
    texts, reasons = [], []
    for row in range(len(prompt_ids)):
        ids = response_ids[row, : int(lengths[row])].tolist()
        done = bool(stopped[row])
        reasons.append("stop" if done else "length")
        if done and ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        texts.append(stops.cut(text, params.include_stop_str_in_output) if done else text)
    n = params.n
    return Completions(
        prompt_ids=[list(p) for p in prompt_ids],
        prompt_index=torch.arange(len(prompt_ids)) // n,
        response_ids=response_ids,
        response_mask=mask,
        logprobs=logprobs if params.logprobs else None,
        lengths=lengths,
        finish_reason=reasons,
        texts=texts,
        pad_token_id=pad_id,
        meta=dict(meta or {}),
    )


@contextlib.contextmanager
def eval_inference(model: torch.nn.Module) -> Iterator[None]:
    """`with eval_inference(model):` eval mode and torch.inference_mode for the block; the
    model's train/eval mode is restored after it, also when it raises."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)
