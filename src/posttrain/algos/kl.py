"""Per-token KL estimators and KL-coefficient controllers.

Notation: B batch, T tokens. `logp` and `ref_logp` (B, T) are log-probs of the
sampled tokens under the policy π and the reference π_ref. The estimators are
Schulman's "Approximating KL Divergence" (2020) for KL(π ‖ π_ref) with samples
from π; each returns a per-token (B, T) tensor for the caller to mask and
aggregate (as a loss term) or to subtract from the reward (KL in reward).
"""

from collections.abc import Callable

import torch

from ._registry import pick


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # Clamps as veRL `low_var_kl`: exp() cannot overflow, and one token with a
    # huge ratio cannot dominate the loss.
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def _abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


KL_KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled tokens.

    Shapes: logp, ref_logp (B, T) → (B, T).
    Formula, with d = logp − ref_logp and samples drawn from π:
        "k1"   d                          unbiased, high variance; TRL/veRL KL-in-reward
        "k2"   ½ d²                       biased, low variance (veRL "mse")
        "k3"   e^{−d} − (−d) − 1 = r − log r − 1 with r = π_ref/π: unbiased,
               ≥ 0, low variance (veRL "low_var_kl", TRL GRPO's β term);
               computed with −d clamped to [−20, 20] and the result to
               [−10, 10] as veRL does
        "abs"  |d|
    """
    return pick(KL_KINDS, kind, "KL kind")(logp, ref_logp)


class FixedKLController:
    """A constant KL coefficient β; `update` does nothing."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep β fixed (same interface as `AdaptiveKLController`)."""


class AdaptiveKLController:
    """Adapt β towards a target KL (Ziegler et al. 2019, arXiv 1909.08593, §2.2).

    Formula, after each batch of n_steps samples with measured KL:
        e = clip(current_kl / target − 1, −0.2, 0.2)
        β ← β · (1 + e · n_steps / horizon)
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got {target}, {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
