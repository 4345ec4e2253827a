"""Reduce a per-token loss (B, T) to a scalar, and the weight to combine parts.

Notation: B batch (rows), T tokens, L = max_len. `mask` is 1 on valid tokens.

A batch split into parts k (micro-batches, ranks) gives the full-batch loss
back as
    loss = Σ_k w_k · loss_k / Σ_k w_k,
    loss_k = aggregate_loss(loss[part k], mask[part k], agg, max_len),
    w_k = aggregation_weight(mask[part k], agg),
because every mode is a sum over tokens divided by a count that adds up over
parts: valid tokens (token-mean), non-empty sequences (seq-mean-*), or rows
(seq-mean-token-sum-norm, whose per-row constant L must be the same in every
part, so pass `max_len` explicitly when parts have different T).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from ._registry import pick
from .masked import masked_mean, masked_sum


def _token_count(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool().sum()


def _nonempty_seqs(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool().any(dim=-1).sum()


def _rows(mask: torch.Tensor) -> torch.Tensor:
    return torch.tensor(mask.shape[:-1].numel(), device=mask.device)


def _token_mean(loss: torch.Tensor, mask: torch.Tensor, max_len: int | None) -> torch.Tensor:
    return masked_mean(loss, mask)


def _seq_mean(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Rows without a valid token (e.g. filtered samples) count as absent.
    return per_seq.sum() / _nonempty_seqs(mask).clamp_min(1)


def _seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, max_len: int | None
) -> torch.Tensor:
    return _seq_mean(masked_mean(loss, mask, dim=-1), mask)


def _seq_mean_token_sum(
    loss: torch.Tensor, mask: torch.Tensor, max_len: int | None
) -> torch.Tensor:
    return _seq_mean(masked_sum(loss, mask, dim=-1), mask)


def _seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, max_len: int | None
) -> torch.Tensor:
    length = loss.shape[-1] if max_len is None else max_len
    return masked_sum(loss, mask) / (loss.shape[:-1].numel() * length)


class Aggregation(NamedTuple):
    """One aggregation mode: the reduction and the weight of a part (module docstring)."""

    reduce: Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor]
    weight: Callable[[torch.Tensor], torch.Tensor]


AGG_MODES: dict[str, Aggregation] = {
    "token-mean": Aggregation(_token_mean, _token_count),
    "seq-mean-token-mean": Aggregation(_seq_mean_token_mean, _nonempty_seqs),
    "seq-mean-token-sum": Aggregation(_seq_mean_token_sum, _nonempty_seqs),
    "seq-mean-token-sum-norm": Aggregation(_seq_mean_token_sum_norm, _rows),
}


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", max_len: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar (veRL `agg_loss` modes).

    Shapes: loss, mask (B, T) → 0-dim tensor. With ℓ_{i,t} the loss, m the
    mask, |y_i| = Σ_t m_{i,t} and B' the number of rows with |y_i| > 0:
        "token-mean"               Σ_{i,t} m ℓ / Σ_{i,t} m
                                   (DAPO token-level loss, arXiv 2503.14476 eq. 8;
                                   TRL `loss_type="dapo"`)
        "seq-mean-token-mean"      (1/B') Σ_i (1/|y_i|) Σ_t m ℓ
                                   (GRPO as written, arXiv 2402.03300 eq. 3; GSPO)
        "seq-mean-token-sum"       (1/B') Σ_i Σ_t m ℓ
        "seq-mean-token-sum-norm"  Σ_{i,t} m ℓ / (B · L), L = max_len, default T
                                   (Dr.GRPO, arXiv 2503.20783; TRL `loss_type="dr_grpo"`)
    `max_len` is used by the last mode only; pass the generation limit there,
    since T, the padded length of this batch, changes from batch to batch.
    Departure: veRL's `agg_loss` computes "seq-mean-token-sum-norm" as
    Σ m ℓ / L (no ÷ B, and L the padded width of the batch). We keep TRL's
    Σ m ℓ / (B · L), which is what makes parts combine by row counts. The
    gradient is B times smaller than veRL's for the same rows, so a grad-norm
    clip (trainer.max_grad_norm) bites less often; Adam's update is otherwise
    scale-free, up to its eps.
    Combining parts of a batch: module docstring and `aggregation_weight`.
    """
    return pick(AGG_MODES, agg, "aggregation mode").reduce(loss, mask, max_len)


def aggregation_weight(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Weight of this part of a batch when averaging `aggregate_loss` over parts.

    Shapes: mask (B, T) → 0-dim integer tensor: the number of valid
    tokens ("token-mean"), of rows with a valid token ("seq-mean-*"), or of
    rows ("seq-mean-token-sum-norm"). Σ_k w_k · loss_k / Σ_k w_k over the parts
    equals the loss of the whole batch (module docstring).
    """
    return pick(AGG_MODES, agg, "aggregation mode").weight(mask)
