"""Pure tensor functions behind every trainer: log-probs, advantages, KL, losses.

Notation everywhere: B batch, T tokens, G group size, V vocab; `mask` (B, T)
is 1 on valid response tokens. Names: logp, old_logp, ref_logp, adv, mask,
values, returns. This package imports only torch. Variants are picked by name
from the tables below (their keys are the valid config values):
`ADV_ESTIMATORS`, `AGG_MODES`, `GRPO_SCALES`, `KL_KINDS`, `RATIO_LEVELS`, `DPO_LOSS_TYPES`,
`IS_LEVELS`, `IS_MODES`.
"""

from .advantages import (
    ADV_ESTIMATORS,
    GRPO_SCALES,
    AdvEstimator,
    compute_gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from .aggregation import AGG_MODES, aggregate_loss, aggregation_weight
from .dapo import filter_groups, overlong_penalty
from .kl import KL_KINDS, AdaptiveKLController, FixedKLController, kl_penalty
from .logprobs import entropy_from_logits, token_logprobs
from .losses import RATIO_LEVELS, policy_loss, value_loss
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .preference import DPO_LOSS_TYPES, bradley_terry_loss, dpo_loss
from .rollout_corr import IS_LEVELS, IS_MODES, rollout_correction, rollout_gap_metrics

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "DPO_LOSS_TYPES",
    "GRPO_SCALES",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "RATIO_LEVELS",
    "AdaptiveKLController",
    "AdvEstimator",
    "FixedKLController",
    "aggregate_loss",
    "aggregation_weight",
    "bradley_terry_loss",
    "compute_gae",
    "dpo_loss",
    "entropy_from_logits",
    "filter_groups",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "rollout_correction",
    "rollout_gap_metrics",
    "token_logprobs",
    "value_loss",
]
