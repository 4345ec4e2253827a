"""Pairwise preference losses: DPO and its variants, Bradley-Terry reward modelling.

Notation: B batch of (chosen, rejected) pairs. Sequence log-probs (B,) are
sums of token log-probs over the completion (the caller reduces (B, T) with
`masked_sum`). With π the policy and π_ref the frozen reference,
    h = (log π(y_c) − log π(y_r)) − (log π_ref(y_c) − log π_ref(y_r)),
the implicit reward margin (divided by β).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._registry import pick


def _sigmoid(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
        -beta * h
    )


def _robust(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    clean = -(1 - label_smoothing) * F.logsigmoid(beta * h)
    flipped = -label_smoothing * F.logsigmoid(-beta * h)
    return (clean - flipped) / (1 - 2 * label_smoothing)


def _hinge(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - beta * h)


def _ipo(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (h - 1 / (2 * beta)) ** 2


DPO_LOSS_TYPES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "robust": _robust,
    "hinge": _hinge,
    "ipo": _ipo,
}


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses and the implicit rewards.

    Shapes: four (B,) sequence log-probs → (losses (B,), chosen_rewards (B,),
    rejected_rewards (B,)); average `losses` yourself (TRL takes the mean).
    Formula, with h as in the module docstring and ε = label_smoothing:
        "sigmoid"  −(1−ε) log σ(βh) − ε log σ(−βh)
                   (DPO, Rafailov et al. 2023, arXiv 2305.18290, eq. 7; ε > 0
                   is conservative DPO, Mitchell 2023)
        "robust"   (−(1−ε) log σ(βh) + ε log σ(−βh)) / (1 − 2ε)
                   (rDPO, Chowdhury et al. 2024, arXiv 2403.00409, as TRL)
        "hinge"    max(0, 1 − βh)  (SLiC-HF, Zhao et al. 2023, arXiv 2305.10425)
        "ipo"      (h − 1/(2β))²  (IPO, Azar et al. 2023, arXiv 2310.12036,
                   eq. 17). TRL feeds IPO per-token *average* log-probs
                   (sums divided by the completion length); pass those to match.
    ε is used by "sigmoid" and "robust" only; 0 ≤ ε < ½.
    Rewards: β (log π(y) − log π_ref(y)) for the chosen and the rejected
    completion, detached (TRL rewards/chosen, rewards/rejected).
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_logratio = chosen_logps - ref_chosen_logps
    rejected_logratio = rejected_logps - ref_rejected_logps
    h = chosen_logratio - rejected_logratio
    losses = pick(DPO_LOSS_TYPES, loss_type, "DPO loss type")(h, beta, label_smoothing)
    return losses, beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Pairwise reward-model loss (Bradley-Terry; InstructGPT, arXiv 2203.02155, eq. 1).

    Shapes: chosen_scores, rejected_scores, margin (B,) → 0-dim mean loss.
    Formula: mean_i −log σ(r_c − r_r − m), with the optional margin m of
    Llama 2 (Touvron et al. 2023, arXiv 2307.09288, eq. 2); m = 0 without it.
    """
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()
