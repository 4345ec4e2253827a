"""Advantage estimators: GAE (PPO), group-relative (GRPO, Dr.GRPO), RLOO, REINFORCE++.

Notation: B batch (responses), T tokens, G group size (responses per prompt;
a group is G consecutive rows, as `repeat(n)` lays them out). Token-level
inputs are (B, T) with `mask` 1 on valid response tokens. Advantages and
returns are regression/policy targets: they are computed without gradient.
`ADV_ESTIMATORS` (end of file) is the table of `algorithm.adv_estimator`.
"""

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from ._registry import pick
from .masked import masked_whiten


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) scores → (B / G, G) float view, one row per prompt."""
    if scores.dim() != 1 or group_size < 1 or scores.numel() % group_size:
        raise ValueError(
            f"scores must be (B,) with B a multiple of group_size={group_size}; "
            f"got shape {tuple(scores.shape)}"
        )
    return scores.to(torch.promote_types(scores.dtype, torch.float32)).view(-1, group_size)


@torch.no_grad()
def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16).

    Shapes: rewards, values, mask (B, T) → advantages (B, T), returns (B, T),
    both 0 on padding.
    Formula (backward over t, visiting valid tokens only):
        δ_t = r_t + γ V_{t'} − V_t
        A_t = δ_t + γ λ A_{t'}
        R_t = A_t + V_t
    where t' is the next valid token after t. After the last valid token
    V_{t'} = A_{t'} = 0: the episode ends there and never bootstraps from
    padding. Interior zeros in `mask` (e.g. tool output in a multi-turn
    response) are skipped, as veRL does: the last model token before an
    observation span bootstraps from the value of the first model token after
    it, discounted once (observation tokens are not time steps), and values and
    rewards at masked positions never enter. No whitening here: PPO callers apply
    `masked_whiten` to the advantages (TRL and veRL defaults do).
    """
    valid = torch.broadcast_to(mask.bool(), rewards.shape)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[..., 0])
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        here = valid[..., t]
        next_adv = torch.where(here, delta + gamma * lam * next_adv, next_adv)
        next_value = torch.where(here, values[..., t], next_value)
        advantages[..., t] = next_adv
    advantages = torch.where(valid, advantages, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def _group_std(groups: torch.Tensor, eps: float) -> torch.Tensor:
    return groups.std(dim=-1, correction=0, keepdim=True) + eps


def _batch_std(groups: torch.Tensor, eps: float) -> torch.Tensor:
    return groups.std(correction=0) + eps


def _no_scale(groups: torch.Tensor, eps: float) -> torch.Tensor:
    return groups.new_ones(())


GRPO_SCALES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "group": _group_std,
    "batch": _batch_std,
    "none": _no_scale,
}


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages (GRPO: Shao et al. 2024, arXiv 2402.03300, §4.1.2).

    Shapes: scores (B,) → adv (B,); rows [kG, (k+1)G) form one group.
    Formula: A_i = (s_i − mean_g(s)) / (σ + eps) where σ is, per `scale`:
        "group"  population std (1/G) of the group,
        "batch"  population std of all B scores (TRL `scale_rewards="batch"`),
        "none"   no division and no eps: A_i = s_i − mean_g(s)
                 (Dr.GRPO: Liu et al. 2025, arXiv 2503.20783).
    Departure: TRL and veRL divide by the Bessel-corrected std (1/(G−1));
    we use the population std as the GRPO formula is written, which makes our
    advantages larger by sqrt(G/(G−1)) (1.07 at G=8). A group whose scores are
    all equal gets A = 0.
    """
    groups = _groups(scores, group_size)
    centred = groups - groups.mean(dim=-1, keepdim=True)
    return (centred / pick(GRPO_SCALES, scale, "GRPO scale")(groups, eps)).view(scores.shape)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, arXiv 2402.14740).

    Shapes: scores (B,) → adv (B,); groups as in `grpo_advantages`; G ≥ 2.
    Formula: A_i = s_i − (1/(G−1)) Σ_{j≠i} s_j = G/(G−1) · (s_i − mean_g(s)).
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
    groups = _groups(scores, group_size)
    baseline = (groups.sum(dim=-1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).view(scores.shape)


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv 2501.03262).

    Shapes: token_rewards, mask (B, T) → adv (B, T), 0 on masked positions.
    Formula (backward over t, visiting valid tokens only, as `compute_gae` does):
        G_t = r_t + γ G_{t'}
    where t' is the next valid token after t (G_{t'} = 0 after the last one); then
    A = masked_whiten(G, mask) over all valid tokens of the batch (global baseline and
    scale instead of a critic). Masked positions are skipped: the running return flows
    through them unchanged, their rewards are not added and they do not discount.
    Departure from veRL: its `compute_reinforce_plus_plus_outcome_advantage` multiplies
    the running return by the mask after each position (`running_return *
    response_mask[:, t]`, `eos_mask` in older versions), so the return of every token
    before a masked position starts again from 0. For a single-turn response the two
    agree (its masked positions are the padding after the end). In a multi-turn episode
    the environment's tokens are masked in the middle of the response, and the reset
    would cut every model turn but the last off the episode's final score.
    """
    valid = torch.broadcast_to(mask.bool(), token_rewards.shape)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[..., 0])
    for t in reversed(range(token_rewards.shape[-1])):
        running = torch.where(valid[..., t], token_rewards[..., t] + gamma * running, running)
        returns[..., t] = running
    return masked_whiten(returns, valid)


# ----------------------------------------------------------------------------- the table


class AdvFn(Protocol):
    """The signature every entry of `ADV_ESTIMATORS` shares; each reads what it needs."""

    def __call__(
        self,
        outcome: torch.Tensor,
        token_rewards: torch.Tensor,
        values: torch.Tensor | None,
        mask: torch.Tensor,
        *,
        group_size: int,
        gamma: float,
        lam: float,
        scale: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def _per_token(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) advantages → (B, T): every valid token of a response carries its row's."""
    return torch.where(mask.bool(), adv[:, None], 0.0)


def _gae(
    outcome: torch.Tensor,
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    group_size: int,
    gamma: float,
    lam: float,
    scale: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if values is None:
        raise ValueError("gae needs the critic's values (B, T); got None")
    return compute_gae(token_rewards, values, mask, gamma, lam)


def _grpo(
    outcome: torch.Tensor,
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    group_size: int,
    gamma: float,
    lam: float,
    scale: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _per_token(grpo_advantages(outcome, group_size, scale), mask), None


def _rloo(
    outcome: torch.Tensor,
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    group_size: int,
    gamma: float,
    lam: float,
    scale: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _per_token(rloo_advantages(outcome, group_size), mask), None


def _reinforce_pp(
    outcome: torch.Tensor,
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    group_size: int,
    gamma: float,
    lam: float,
    scale: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return reinforce_pp_advantages(token_rewards, mask, gamma), None


class AdvEstimator(NamedTuple):
    """One advantage estimator and what its caller has to know about it."""

    fn: AdvFn
    """(outcome, token_rewards, values, mask, *, group_size, gamma, lam, scale) → (adv, returns or None)."""
    needs_values: bool
    """Reads a critic's values: the run trains a critic (PPO), and whitens by default."""
    whitens: bool
    """Whitens its output itself: the caller must not whiten it again."""
    grouped: bool
    """Compares the G responses of a prompt: needs G ≥ 2 and each group's rows contiguous."""
    scale: str | None = None
    """The one `GRPO_SCALES` name the estimator is defined with (dr_grpo: "none"), or None
    when the user chooses (a grouped estimator then defaults to "group")."""


ADV_ESTIMATORS: dict[str, AdvEstimator] = {
    "gae": AdvEstimator(_gae, needs_values=True, whitens=False, grouped=False),
    "grpo": AdvEstimator(_grpo, needs_values=False, whitens=False, grouped=True),
    "dr_grpo": AdvEstimator(_grpo, needs_values=False, whitens=False, grouped=True, scale="none"),
    "rloo": AdvEstimator(_rloo, needs_values=False, whitens=False, grouped=True),
    "reinforce_pp": AdvEstimator(_reinforce_pp, needs_values=False, whitens=True, grouped=False),
}
"""`algorithm.adv_estimator` → estimator. Inputs: outcome (B,) the sequence reward of
each row; token_rewards (B, T); values (B, T), read only where needs_values; mask (B, T),
1 on the tokens that get an advantage; group_size G; gamma, lam (gae; gamma also
reinforce_pp); scale, a `GRPO_SCALES` name (grpo, dr_grpo; the entry's own `scale` when
it has one). Output: advantages (B, T), 0 off the mask, and from gae the critic's targets
(B, T), else None."""
