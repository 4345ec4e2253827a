"""Next-token sampling, shared by every engine: the filters (top-k, top-p, min-p), the pick
(`sample_next`: the exponential race or the inverse CDF) and the call's randomness (`Draws`,
`SamplingParams.seed_mode`: one torch.Generator per call, or one counter-based uniform per row
and token). Log-probabilities follow `rollout/base.py`'s definition: log softmax(logits / T),
before the filters.
"""

from __future__ import annotations

import torch

from posttrain.rollout.base import SamplingParams


def resolve_seed(seed: int | None) -> int:
    """The call's seed; None draws one from torch's global (CPU) RNG."""
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 2**62, (1,)).item())


def stream_seed(seed: int, first_position: int) -> int:
    """The seed of a batch-mode random stream (a torch.Generator) that starts at token
    `first_position` of the responses: `seed` itself at 0, else a hash of both, so the segments
    of a resumed generation draw fresh noise."""
    if first_position == 0:
        return seed
    return (_fmix32(_fmix32(seed & _M32) ^ (first_position & _M32)) << 31) | (seed & (2**31 - 1))


def filter_logits(
    z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, then top-p, then min-p exclude.

    z (N, V) temperature-scaled logits -> (N, V). The order and the rules are those of
    transformers' warpers (TopK, TopP, MinP): top-k keeps ties with the k-th logit;
    top-p drops a token when the mass of the less probable tokens including it is
    <= 1 - top_p (so the most probable token always stays); min-p drops
    p < min_p · max p.
    """
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1)  # ascending
        mass_below = sorted_z.softmax(-1).cumsum(-1)
        drop = mass_below <= 1 - top_p
        drop[:, -1] = False
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return z


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    noise: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row and its logprob.

    logits (N, V) (any float dtype; computed in float32); unless greedy, either noise
    (N, V) i.i.d. Exp(1) draws or uniform (N,) U[0, 1) draws (one per row). Returns
    tokens (N,) long and logp (N,) float32 = log softmax(logits / T)[token] (T = 1 when
    greedy; unfiltered, see module docstring).

    With noise, sampling is the exponential race argmax_v p_v / E_v with E_v ~ Exp(1),
    which picks v with probability p_v (the trick vLLM uses). With uniform, it is the
    inverse CDF (`inverse_cdf`). Either way the caller draws the randomness, so the sample
    of a row depends only on its own logits and draws, not on which rows share the batch.
    """
    z = logits.float()
    if params.temperature > 0:
        z = z / params.temperature
    logp_all = torch.log_softmax(z, dim=-1)
    if params.greedy:
        tokens = z.argmax(-1)
    else:
        probs = filter_logits(z, params.top_k, params.top_p, params.min_p).softmax(-1)
        if uniform is not None:
            tokens = inverse_cdf(probs, uniform)
        elif noise is not None:
            # A zero noise draw (probability ~2^-24 per element) must not make 0/0.
            tokens = (probs / noise.clamp_min(1e-20)).argmax(-1)
        else:
            raise ValueError("sample_next needs Exp(1) noise or uniform draws when temperature > 0")
    return tokens, logp_all.gather(-1, tokens[:, None])[:, 0]


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds each row's draw: probs (N, V) (rows sum to ~1),
    uniform (N,) in [0, 1) -> (N,) long, the first v with C_v > u·C_V, where
    C_v = Σ_{w ≤ v} p_w (in float64), so v is picked with probability p_v / C_V and a token
    of probability 0 never is (its interval is empty; the rounding case u·C_V = C_V takes
    the last token of positive probability)."""
    cdf = probs.double().cumsum(-1)  # (N, V)
    target = (uniform.to(cdf.device, torch.float64) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0]
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).long().argmax(-1)  # last positive probability
    return torch.minimum(tokens, last)


# Row mode's draws: a counter-based hash (MurmurHash3's 32-bit finaliser, a bijection of
# [0, 2^32)) chained over the words of (seed, row, position), in exact int64 arithmetic: each
# multiplier is taken as c - 2^32, so |h·c| < 2^63 never overflows, and `& _M32` is mod 2^32.
_M32 = 0xFFFFFFFF
_FMIX = (0x85EBCA6B - 2**32, 0xC2B2AE35 - 2**32)


def _fmix32(h: torch.Tensor | int) -> torch.Tensor | int:
    h = h ^ (h >> 16)
    h = (h * _FMIX[0]) & _M32
    h = h ^ (h >> 13)
    h = (h * _FMIX[1]) & _M32
    return h ^ (h >> 16)


def row_uniforms(seed: int, rows: torch.Tensor, position: int) -> torch.Tensor:
    """(R,) float64 U[0, 1) draws, one per row: a function of (seed, rows[i], position) alone
    (so of no other row, nor of the device). rows (R,) long, 0 <= row < 2^32; seed any int
    (taken mod 2^64). 53 bits from two chained hashes h(seed, row, position, stream)."""
    seed %= 2**64
    h = _fmix32(_fmix32(seed & _M32) ^ (seed >> 32))  # a Python int: the seed's words
    h = _fmix32((rows.long() & _M32) ^ h)
    h = _fmix32(h ^ (int(position) & _M32))
    hi, lo = _fmix32(h ^ 0x68E31DA4), _fmix32(h ^ 0x1B56C4E9)
    return ((hi << 21) + (lo >> 11)).double() * 2.0**-53


class Draws:
    """The random draws of one engine call (`SamplingParams.seed_mode`).

    batch: one torch.Generator seeded with the call's seed on `device`; every step draws
    Exp(1) noise for all `width` rows of the group being decoded (so a row's draw does not
    depend on which rows are still running), each row reading its own; a resumed call's
    generator is seeded with `stream_seed(seed, first_position)`. row: one uniform per row and
    step, `row_uniforms(seed, params.draw_rows(first + row), params.first_position + step)`,
    nothing drawn for finished rows. Greedy draws nothing."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params, self.seed = params, resolve_seed(params.seed)
        self.gen = None
        if params.seed_mode == "batch" and not params.greedy:
            self.gen = torch.Generator(device).manual_seed(stream_seed(self.seed, params.first_position))

    def sample(
        self, logits: torch.Tensor, rows: torch.Tensor | list[int], width: int, step: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_next` of logits (R, V), the rows `rows` (R, increasing) of a group of `width`
        rows decoded together whose first is row `first` of the call; step: the rows' token
        index (the same for all of them)."""
        p = self.params
        if p.greedy:
            return sample_next(logits, p)
        if self.gen is None:
            idx = p.draw_rows(torch.as_tensor(rows, dtype=torch.long) + first)
            return sample_next(logits, p, uniform=row_uniforms(self.seed, idx, p.first_position + step))
        noise = torch.empty(width, logits.shape[-1], device=self.gen.device).exponential_(generator=self.gen)
        noise = noise if len(rows) == width else noise[rows]
        return sample_next(logits, p, noise=noise.to(logits.device))
