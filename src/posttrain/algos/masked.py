"""Reductions over valid tokens only.

Notation: B batch, T tokens. `mask` is nonzero (True or 1.0) on valid response
tokens and zero on padding; float and bool masks are both accepted and treated
as boolean. Padded positions are dropped with `torch.where`, not multiplied by
zero, so whatever sits under the padding (even inf or nan) never reaches a
result. An all-padding selection reduces to 0, not nan.
"""

import torch


def _valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask broadcast to the common shape of `x` and `mask`."""
    return torch.broadcast_to(mask.bool(), torch.broadcast_shapes(x.shape, mask.shape))


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of `x` over valid positions: Σ_t x_t · m_t.

    Shapes: x and mask broadcastable, e.g. (B, T). `dim=None` reduces to a
    0-dim tensor; otherwise the given dims are reduced, e.g. dim=-1 → (B,).
    """
    kept = torch.where(_valid(x, mask), x, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of `x` over valid positions: Σ_t x_t · m_t / Σ_t m_t.

    Shapes: as `masked_sum`. A reduction with no valid position gives 0.
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all valid positions (a 0-dim tensor).

    Shapes: x and mask (B, T) or any broadcastable pair.
    Formula: μ = masked_mean(x); var = Σ m (x − μ)² / (n − 1) with n = Σ m when
    `unbiased` (Bessel's correction, as veRL's `masked_var`), else / n.
    With n ≤ 1 the variance is 0.
    """
    mean = masked_mean(x, mask)
    centred_sq = masked_sum((x - mean) ** 2, mask)
    n = masked_sum(torch.ones_like(x), mask)
    return centred_sq / ((n - 1) if unbiased else n).clamp_min(1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `x` to zero mean and unit variance over the valid positions.

    Shapes: x and mask (B, T) → (B, T); padding positions are 0 in the output.
    Formula: (x − μ) / sqrt(var + eps), with μ and the unbiased var taken over
    all valid tokens of the batch (`masked_var`); `shift_mean=False` adds μ
    back, rescaling without centring. This is the advantage whitening of PPO
    implementations (veRL `masked_whiten`, TRL PPO `whiten`).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(_valid(x, mask), whitened, 0.0)
