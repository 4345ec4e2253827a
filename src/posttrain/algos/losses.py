"""PPO-family policy loss (PPO, GRPO, DAPO, GSPO, Dr.GRPO) and the clipped value loss.

Notation: B batch, T tokens. logp (B, T) are the sampled tokens' log-probs
under the current policy (with gradient), old_logp (B, T) under the policy
that generated them, adv (B,) or (B, T), mask (B, T) 1 on valid tokens.
Targets (old_logp, adv, old_values, returns) are detached. Padded positions
are replaced by 0 before any arithmetic, so what they hold never reaches the
loss, its gradient or the metrics.

Metrics are detached 0-dim tensors (no host sync; call `.item()` when
logging), always averaged over valid tokens whatever `agg` is.
"""

from collections.abc import Callable

import torch

from ._registry import pick
from .aggregation import aggregate_loss
from .masked import masked_mean


def _token_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    # ±20 as veRL's vanilla PPO loss: exp() stays finite.
    return (logp - old_logp).clamp(-20.0, 20.0)


def _sequence_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    # GSPO-token: the value of every token's ratio is the sequence ratio s_i, the
    # gradient flows through the token's own logp (∇ log s_{i,t} = ∇ logp_t).
    # Clamped above at 10 only, as veRL's compute_policy_loss_gspo (policy_loss docstring).
    seq_log_ratio = masked_mean(logp - old_logp, valid, dim=-1).unsqueeze(-1)
    return (seq_log_ratio.detach() + logp - logp.detach()).clamp(max=10.0)


RATIO_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    level: str = "token",
    agg: str = "token-mean",
    max_len: int | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss with decoupled clip bounds.

    Shapes: logp, old_logp, mask (B, T); adv (B, T), or (B,) shared by all
    tokens of a response; is_weights (B, T) or None → (0-dim loss, metrics).
    Formula (PPO, Schulman et al. 2017, arXiv 1707.06347, eq. 7, as a loss):
        r_t = exp(ρ_t),  ρ_t the clamped log-ratio of `level` (below)
        ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1 − clip_low, 1 + clip_high))
        ℓ_t ← w_t · ℓ_t  with w = is_weights, the rollout correction's weights
              (`posttrain.algos.rollout_correction`; veRL multiplies pg_losses the same way)
    then `aggregate_loss(ℓ, mask, agg, max_len)`. A token of weight 0 still counts
    in the aggregation's denominator (as TRL's masked IS).
    - clip_high > clip_low is DAPO's clip-higher (arXiv 2503.14476, eq. 8).
    - dual_clip = c > 1 (Ye et al. 2020, arXiv 1912.09729): for A_t < 0,
      ℓ_t = min(ℓ_t, −c A_t), bounding the loss when r_t ≫ 1.
    - level "token": ρ_t = clamp(logp_t − old_logp_t, −20, 20) (PPO, GRPO,
      DAPO; veRL's bounds).
      level "sequence": GSPO-token (Zheng et al. 2025, arXiv 2507.18071)
        ρ_t = min(sg[(1/|y|) Σ_t (logp_t − old_logp_t)] + logp_t − sg[logp_t], 10),
      i.e. every token's value is the length-normalised sequence ratio s_i and
      ∇ℓ = −A s_i ∇logp_t while unclipped. With (B,) advantages and
      agg="seq-mean-token-mean" this is GSPO's sequence-level objective.
      The upper clamp at 10 is veRL's (compute_policy_loss_gspo), kept so that
      runs compare number for number. It matters for A < 0: the clip does not
      bound r there (max(−A r, −A clip(r)) takes −A r once r > 1 + clip_high),
      so a sequence with log s_i = 12 would get a gradient of e^12 ≈ 1.6e5 · |A|
      per token. Beyond 10 the clamp makes the loss the constant −A e^10
      (≈ 2.2e4 · |A|) with zero gradient: such a sequence is too far off-policy
      for its ratio to mean anything. No lower clamp: e^ρ → 0 as ρ → −∞ and so
      does its gradient, there is nothing to overflow. dual_clip, when set,
      bounds the loss of A < 0 sooner (at −c A).
    Metrics, fractions of valid tokens:
        clip_frac/high   A > 0 and r > 1 + clip_high (clipped, no gradient)
        clip_frac/low    A < 0 and r < 1 − clip_low (clipped, no gradient)
        clip_frac        their sum (TRL clip_ratio/region_mean, veRL pg_clipfrac)
        clip_frac/dual   A < 0 and r > c (the dual clip is active; 0 without it)
        approx_kl        mean of old_logp − logp, the k1 estimate of
                         KL(π_old ‖ π) from tokens sampled by π_old (veRL ppo_kl);
                         it can be slightly negative
        ratio/mean       mean of r
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    valid = torch.broadcast_to(mask.bool(), logp.shape)
    if adv.dim() == logp.dim() - 1:
        adv = adv.unsqueeze(-1)
    adv = torch.where(valid, adv.detach(), 0.0)
    logp = torch.where(valid, logp, 0.0)
    old_logp = torch.where(valid, old_logp.detach(), 0.0)

    ratio = torch.exp(pick(RATIO_LEVELS, level, "ratio level")(logp, old_logp, valid))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    if is_weights is not None:
        per_token = per_token * torch.where(valid, is_weights.detach(), 0.0)
    loss = aggregate_loss(per_token, valid, agg, max_len)
    return loss, _policy_metrics(logp, old_logp, ratio, adv, valid, clip_low, clip_high, dual_clip)


@torch.no_grad()
def _policy_metrics(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> dict[str, torch.Tensor]:
    high = (adv > 0) & (ratio > 1.0 + clip_high)
    low = (adv < 0) & (ratio < 1.0 - clip_low)
    dual = (adv < 0) & (ratio > (torch.inf if dual_clip is None else dual_clip))
    return {
        "clip_frac": masked_mean((high | low).float(), valid),
        "clip_frac/low": masked_mean(low.float(), valid),
        "clip_frac/high": masked_mean(high.float(), valid),
        "clip_frac/dual": masked_mean(dual.float(), valid),
        "approx_kl": masked_mean(old_logp - logp, valid),
        "ratio/mean": masked_mean(ratio, valid),
    }


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = None,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss (PPO2 baselines; TRL and veRL critics).

    Shapes: values (current critic, with gradient), old_values (critic at
    rollout time), returns (targets), mask: all (B, T) → (0-dim loss, metrics).
    Formula:
        ℓ_t = ½ max((V_t − R_t)², (clip(V_t, V_old − c, V_old + c) − R_t)²)
    with c = `clip`, or ℓ_t = ½ (V_t − R_t)² when clip is None; then
    `aggregate_loss(ℓ, mask, agg)`.
    Metrics: `vf_clip_frac`, the fraction of valid tokens where the clip binds
    and decides the loss, i.e. |V_t − V_old| > c and the clipped error is the
    larger one (the loss is then constant in V_t: no gradient); 0 when clip is
    None. veRL's vf_clipfrac counts only the second condition; without the
    first, V_old + (V − V_old) can differ from V in the last bit and a token
    the clip never touched would count whenever that rounding makes its error
    larger.
    """
    valid = torch.broadcast_to(mask.bool(), values.shape)
    values = torch.where(valid, values, 0.0)
    old_values = torch.where(valid, old_values.detach(), 0.0)
    returns = torch.where(valid, returns.detach(), 0.0)

    error = (values - returns) ** 2
    clipped_error, bound = error, torch.zeros_like(valid)
    if clip is not None:
        delta = values - old_values
        clipped_values = old_values + delta.clamp(-clip, clip)
        clipped_error = (clipped_values - returns) ** 2
        bound = delta.abs() > clip
    loss = aggregate_loss(0.5 * torch.maximum(error, clipped_error), valid, agg)
    with torch.no_grad():
        clipped = bound & (clipped_error > error)
        metrics = {"vf_clip_frac": masked_mean(clipped.float(), valid)}
    return loss, metrics
