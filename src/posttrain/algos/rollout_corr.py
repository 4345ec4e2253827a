"""Rollout correction: importance weights for the gap between the engine that sampled a
response and the trainer that learns from it, and the metrics that measure that gap.

Notation: B rows, T response tokens; `mask` (B, T) is 1 on valid (trained) tokens.
old_logp (B, T): log-probs of the sampled tokens under the trainer's behaviour policy π_old
(the actor's recompute pass); rollout_logp (B, T): the same tokens' log-probs as the rollout
engine reported them (π_rollout: same weights, other kernels, KV-cache decoding, bf16).
δ_t = old_logp_t − rollout_logp_t is the per-token log-ratio log π_old / π_rollout; padding
is replaced by 0 before any arithmetic, so what it holds never reaches a weight or a metric.

Metrics are detached 0-dim tensors under veRL's names (`verl/trainer/ppo/rollout_corr_helper.py`).
"""

from collections.abc import Callable

import torch

from ._registry import pick
from .masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ±20 before exp (veRL's SAFETY_BOUND): a weight stays finite."""


def _token_log_ratio(delta: torch.Tensor, valid: torch.Tensor, mode: str) -> torch.Tensor:
    return delta


def _sequence_log_ratio(delta: torch.Tensor, valid: torch.Tensor, mode: str) -> torch.Tensor:
    # truncate: the product of the token ratios (Yao et al., TRL sequence_truncate);
    # mask: their geometric mean, so a long response is not rejected for its length alone.
    seq = masked_sum(delta, valid, dim=-1) if mode == "truncate" else masked_mean(delta, valid, dim=-1)
    return seq.unsqueeze(-1).expand_as(delta)


IS_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}
"""Where a weight's log-ratio comes from (`rollout_correction`'s `level`)."""


def _truncate(ratio: torch.Tensor, c_low: float | None, c_high: float) -> torch.Tensor:
    return ratio.clamp(min=c_low, max=c_high)


def _mask(ratio: torch.Tensor, c_low: float | None, c_high: float) -> torch.Tensor:
    inside = (ratio <= c_high) & (ratio >= (c_low if c_low is not None else 0.0))
    return torch.where(inside, ratio, 0.0)


IS_MODES: dict[str, Callable[[torch.Tensor, float | None, float], torch.Tensor]] = {
    "truncate": _truncate,
    "mask": _mask,
}
"""What a ratio outside [c_low, c_high] becomes (`rollout_correction`'s `mode`)."""


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    c_low: float | None = None,
    c_high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights w (B, T) that multiply the policy-gradient term of the loss, so a
    batch sampled by the engine (π_rollout) trains as if sampled by π_old.

    Shapes: old_logp, rollout_logp, mask (B, T) → weights (B, T), detached, 0 on padding,
    and metrics. With δ_t = old_logp_t − rollout_logp_t over a row's valid tokens:
        level "token",    mode "truncate"  w_t = clamp(exp(δ_t), c_low, c_high)
            (token-level TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
            You Off-Policy RL Training"; c_low None = no lower bound, w_t = min(exp(δ_t), C))
        level "sequence", mode "truncate"  w = clamp(exp(Σ_t δ_t), c_low, c_high), on every token
            (sequence-level TIS; TRL's sequence_truncate)
        level "token",    mode "mask"      w_t = exp(δ_t) if c_low ≤ exp(δ_t) ≤ c_high else 0
            (IcePop, Ling team 2025 "Every Step Evolves: Scaling Reinforcement Learning for
            Trillion-Scale Thinking Model"; TRL's token_mask)
        level "sequence", mode "mask"      ρ = exp((1/|y|) Σ_t δ_t), the geometric mean of the
            token ratios; w = ρ if c_low ≤ ρ ≤ c_high else 0, on every token (masked IS, MIS:
            Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
            Training-Inference Mismatch"; the bound on the geometric mean is veRL's Geo-RS,
            `rollout_rs=seq_mean_k1`)
    Log-ratios are clamped to ±SAFETY_BOUND before exp. c_low None = 0 (no lower bound).
    The weights are constants of the loss (no gradient): they change the measure the
    gradient is averaged under, not the objective.

    Metrics (`rollout_gap_metrics`, plus, with ρ the ratio of `level` before truncation or
    masking, as veRL's `compute_is_metrics`):
        rollout_corr/rollout_is_mean|max|min  mean, max, min of ρ over valid tokens
        rollout_corr/rollout_is_eff_sample_size  (mean w)² / mean(w²) over valid tokens:
            1 / mean((w / mean w)²), the effective sample size as a fraction of the tokens
            (1: all weights equal; 0 when every weight is 0). veRL clamps its weights to
            [1/C, C] first; these are the weights the loss uses.
        rollout_corr/rollout_rs_masked_fraction  fraction of valid tokens whose weight the
            mask set to 0 (0 in truncate mode)
    """
    if c_high <= 0 or (c_low is not None and not 0 <= c_low < c_high):
        raise ValueError(f"rollout correction bounds: need 0 <= c_low < c_high, got c_low={c_low}, c_high={c_high}")
    valid = torch.broadcast_to(mask.bool(), old_logp.shape)
    delta = torch.where(valid, old_logp.detach() - rollout_logp.detach(), 0.0)
    log_ratio = pick(IS_LEVELS, level, "rollout correction level")(delta, valid, mode)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    weights = torch.where(valid, pick(IS_MODES, mode, "rollout correction mode")(ratio, c_low, c_high), 0.0)
    metrics = rollout_gap_metrics(old_logp, rollout_logp, mask)
    with torch.no_grad():
        metrics.update({
            "rollout_corr/rollout_is_mean": masked_mean(ratio, valid),
            "rollout_corr/rollout_is_max": _masked_extreme(ratio, valid, torch.amax),
            "rollout_corr/rollout_is_min": _masked_extreme(ratio, valid, torch.amin),
            "rollout_corr/rollout_is_eff_sample_size": _eff_sample_size(weights, valid),
            "rollout_corr/rollout_rs_masked_fraction": masked_mean(((weights == 0) & (ratio != 0)).to(ratio.dtype), valid),
        })
    return weights, metrics


def _masked_extreme(x: torch.Tensor, valid: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """max or min of x over valid positions (0 when there is none)."""
    return reduce(x[valid]) if bool(valid.any()) else x.new_zeros(())


def _eff_sample_size(w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    mean_sq = masked_mean(w.square(), valid)
    return torch.where(mean_sq > 0, masked_mean(w, valid).square() / mean_sq.clamp_min(1e-30), 0.0)


@torch.no_grad()
def rollout_gap_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the engine's log-probs are from the trainer's, as veRL's
    `compute_offpolicy_metrics` measures it (logged whenever the engine returns log-probs,
    correction on or off).

    Shapes: old_logp, rollout_logp, mask (B, T) → 0-dim tensors. With δ_t = old_logp_t −
    rollout_logp_t, means over valid tokens, and d_i = (1/|y_i|) Σ_t δ_{i,t} averaged over
    the rows that have a valid token:
        rollout_corr/kl                mean of −δ_t: the k1 estimate of KL(π_rollout ‖ π_old)
                                       from the engine's samples (can be slightly negative)
        rollout_corr/k3_kl             mean of exp(δ_t) − δ_t − 1 (k3, ≥ 0)
        rollout_corr/log_ppl_abs_diff  mean_i |d_i|: |log PPL_old − log PPL_rollout| per row
        rollout_corr/ppl_ratio         mean_i exp(−d_i): PPL_old / PPL_rollout per row
    All are 0 (ppl_ratio 1) when the engine and the trainer agree.
    """
    valid = torch.broadcast_to(mask.bool(), old_logp.shape)
    delta = torch.where(valid, old_logp - rollout_logp, 0.0)
    delta = delta.to(torch.promote_types(delta.dtype, torch.float32))  # bf16 engines: measured in fp32
    rows = valid.any(dim=-1)
    per_row = masked_mean(delta, valid, dim=-1)
    k3 = torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - delta - 1.0
    return {
        "rollout_corr/kl": masked_mean(-delta, valid),
        "rollout_corr/k3_kl": masked_mean(k3, valid),
        "rollout_corr/log_ppl_abs_diff": masked_mean(per_row.abs(), rows),
        "rollout_corr/ppl_ratio": masked_mean(torch.exp(-per_row), rows) if bool(rows.any()) else delta.new_ones(()),
    }
