"""The algorithm of an RL run: the advantage estimator, the KL term, DAPO's data tricks, the
rollout correction (`RLConfig.algorithm`), and the actor's clipped surrogate loss (`RLConfig.actor.policy_loss`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from posttrain.algos import ADV_ESTIMATORS, AdvEstimator
from posttrain.config.aliases import aliases, openrlhf, trl, verl
from posttrain.config.core import check
from posttrain.config.sections import RefSyncConfig

log = logging.getLogger(__name__)

AdvEstimatorName = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"]
"""The keys of `posttrain.algos.ADV_ESTIMATORS`, spelt out for the validator, the docs and
type checkers (tests/algos/test_registries.py checks that they stay equal)."""

ADV_ESTIMATOR_ALIASES = aliases(
    verl("algorithm.adv_estimator", {"gae": "gae", "grpo": "grpo", "rloo": "rloo",
                                     "reinforce_plus_plus": "reinforce_pp"}),
    openrlhf("advantage_estimator", {"gae": "gae", "group_norm": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo",
                                     "reinforce": "reinforce_pp"}),
)
"""algorithm.adv_estimator of GRPO and PPO alike (veRL's grpo without std scaling is dr_grpo)."""

BOTH_SIDES = "it sets both sides: also set actor.policy_loss.clip_high (DAPO's clip-higher is clip_high > clip_low)"
"""A single clip range of TRL, veRL and OpenRLHF is our clip_low and clip_high."""

VERL_KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}
"""veRL's KL estimator names → ours (`posttrain.algos.kl_penalty`)."""


@dataclass
class PolicyLossConfig:
    """The clipped surrogate loss (`posttrain.algos.policy_loss`)."""

    level: Literal["token", "sequence"] = field(default="token", metadata=aliases(
        trl("importance_sampling_level"),
        verl("actor_rollout_ref.actor.policy_loss.loss_mode", {"vanilla": "token", "gspo": "sequence"})))
    """Importance ratio per token (PPO, GRPO, DAPO) or per sequence, length-normalised (GSPO)."""
    clip_low: float = field(default=0.2, metadata=aliases(
        trl("epsilon", note=BOTH_SIDES), trl("cliprange", note=BOTH_SIDES),
        verl("actor_rollout_ref.actor.clip_ratio_low"), verl("actor_rollout_ref.actor.clip_ratio", note=BOTH_SIDES),
        openrlhf("eps_clip", note=BOTH_SIDES)))
    """ε_low: the ratio is clipped below at 1 − clip_low."""
    clip_high: float = field(default=0.2, metadata=aliases(
        trl("epsilon_high"), verl("actor_rollout_ref.actor.clip_ratio_high")))
    """ε_high: the ratio is clipped above at 1 + clip_high; > clip_low is DAPO's clip-higher."""
    dual_clip: float | None = field(default=None, metadata=aliases(verl("actor_rollout_ref.actor.clip_ratio_c")))
    """Dual-clip constant c > 1 bounding the loss of negative advantages (veRL uses 3.0); null = off."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = field(
        default="token-mean", metadata=aliases(
            trl("loss_type", {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                              "dr_grpo": "seq-mean-token-sum-norm"}),
            verl("actor_rollout_ref.actor.loss_agg_mode")))
    """How per-token losses become one number (`posttrain.algos.aggregate_loss`): token-mean
    (DAPO, TRL `loss_type="dapo"`, veRL default), seq-mean-token-mean (GRPO paper, GSPO),
    seq-mean-token-sum, seq-mean-token-sum-norm (Dr.GRPO: ÷ rows · rollout.max_new_tokens; for episodes
    min(max_turns · max_new_tokens, max_total_tokens))."""

    def validate(self) -> None:
        check(0 <= self.clip_low < 1, "actor.policy_loss.clip_low", f"must be in [0, 1), got {self.clip_low}")
        check(self.clip_high >= 0, "actor.policy_loss.clip_high", f"must be >= 0, got {self.clip_high}")
        check(self.dual_clip is None or self.dual_clip > 1, "actor.policy_loss.dual_clip",
              f"must be > 1 (or null), got {self.dual_clip}")


KL_COEF_DEFAULT = 0.001


@dataclass
class KLConfig:
    """The KL(π ‖ π_ref) regulariser; the reference model is loaded only when one is on."""

    in_reward: bool = field(default=False, metadata=aliases(verl("algorithm.use_kl_in_reward")))
    """Subtract coef · KL_t from every token's reward (InstructGPT/PPO style)."""
    in_loss: bool = field(default=False, metadata=aliases(
        verl("actor_rollout_ref.actor.use_kl_loss"), openrlhf("use_kl_loss")))
    """Add coef · KL to the actor loss (GRPO; TRL's β > 0)."""
    kind: Literal["k1", "k2", "k3", "abs"] | None = field(default=None, metadata=aliases(
        verl("actor_rollout_ref.actor.kl_loss_type", VERL_KL), verl("algorithm.kl_penalty", VERL_KL),
        trl("kl_estimator"), openrlhf("kl_estimator")))
    """Estimator (`posttrain.algos.kl_penalty`); null = k1 in the reward, k3 in the loss (the anchors' defaults)."""
    coef: float = field(default=KL_COEF_DEFAULT, metadata=aliases(
        trl("beta", note="the KL term acts only with algorithm.kl.in_loss=true (TRL adds it to the loss when beta > 0)"),
        trl("kl_coef", note="the KL term acts only with algorithm.kl.in_reward=true (TRL's PPO and RLOO "
            "put it in the reward)"),
        verl("actor_rollout_ref.actor.kl_loss_coef", note="acts with use_kl_loss=true, here "
             "algorithm.kl.in_loss=true"),
        verl("algorithm.kl_ctrl.kl_coef", note="acts with use_kl_in_reward=true, here algorithm.kl.in_reward=true"),
        openrlhf("init_kl_coef", note="in the reward (algorithm.kl.in_reward=true), or the loss with use_kl_loss "
                 "(algorithm.kl.in_loss=true)")))
    """β (veRL's default 0.001). It acts only with in_loss or in_reward on: set apart from its
    default with both off it is refused, as it would do nothing. TRL GRPO's `beta` > 0 is
    in_loss=true with coef=beta; TRL's beta=0 (its default) is both off (coef unset or 0)."""
    adaptive: bool = field(default=False, metadata=aliases(
        verl("algorithm.kl_ctrl.type", {"fixed": False, "adaptive": True})))
    """Adapt β towards `target` (Ziegler et al. 2019) instead of keeping it fixed (needs a KL term)."""
    target: float = field(default=6.0, metadata=aliases(verl("algorithm.kl_ctrl.target_kl"), openrlhf("kl_target")))
    """Target KL of the adaptive controller."""
    horizon: int = field(default=10000, metadata=aliases(verl("algorithm.kl_ctrl.horizon"), openrlhf("kl_horizon")))
    """Horizon (samples) of the adaptive controller."""

    def validate(self) -> None:
        check(self.coef >= 0, "algorithm.kl.coef", f"must be >= 0, got {self.coef}")
        check(self.target > 0 and self.horizon > 0, "algorithm.kl.target", "target and horizon must be > 0")
        idle = [f"algorithm.kl.coef={self.coef:g}"] if self.coef not in (0.0, KL_COEF_DEFAULT) else []
        idle += ["algorithm.kl.adaptive=true"] if self.adaptive else []
        if idle and not self.enabled:
            check(False, idle[0].partition("=")[0],
                  f"{' and '.join(idle)} would do nothing: the KL term is off. Put it in the loss with "
                  "algorithm.kl.in_loss=true (what TRL's GRPOTrainer does for beta > 0; veRL use_kl_loss) or "
                  "in the reward with algorithm.kl.in_reward=true (veRL use_kl_in_reward, TRL's PPO); for no "
                  "KL (TRL's beta=0), leave algorithm.kl.coef unset or 0 and adaptive false")

    @property
    def enabled(self) -> bool:
        return self.in_reward or self.in_loss


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment (eq. 13), added to the score."""

    buffer: int = field(default=0, metadata=aliases(verl("reward_model.overlong_buffer.len")))
    """L_cache: the penalty ramps from 0 to −penalty over the last `buffer` tokens before
    rollout.max_new_tokens (0 = off). For episodes the length is the episode's model tokens
    and the limit min(multi_turn.max_turns · max_new_tokens, multi_turn.max_total_tokens)."""
    penalty: float = field(default=1.0, metadata=aliases(verl("reward_model.overlong_buffer.penalty_factor")))
    """α: the penalty at the length limit."""


TRL_IS_MODES = {"token_truncate": "token", "token_mask": "token", "sequence_truncate": "sequence",
                "sequence_mask": "sequence"}
"""TRL's vllm_importance_sampling_mode → our rollout_is (the part after `_` is rollout_is_mode)."""


@dataclass
class RolloutCorrectionConfig:
    """Correcting the gap between the engine's log-probs and the trainer's (vLLM's kernels,
    bf16, KV-cache decoding): importance weights on the policy-gradient term
    (`posttrain.algos.rollout_correction`, docs/rollout_correction.md). Needs the engine's
    log-probs, rollout.calculate_log_probs (true by default when this is on)."""

    rollout_is: Literal["token", "sequence"] | None = field(default=None, metadata=aliases(
        trl("vllm_importance_sampling_mode", TRL_IS_MODES,
            note="also set algorithm.rollout_correction.rollout_is_mode to the part after the underscore "
                 "(truncate or mask); TRL's sequence_mask bounds the product of the ratios, ours their "
                 "geometric mean"),
        trl("vllm_importance_sampling_correction", same_value=False,
            note="TRL's default (true with sequence_mask and a cap of 3) is rollout_is=sequence, "
                 "rollout_is_mode=mask, rollout_is_threshold=3; false is rollout_is=null (the default)"),
        verl("algorithm.rollout_correction.rollout_is"), verl("algorithm.rollout_is_level")))
    """Importance weights per token (TIS, IcePop) or per sequence (sequence TIS, MIS);
    null = no correction (the gap is still logged with rollout.calculate_log_probs=true)."""
    rollout_is_mode: Literal["truncate", "mask"] = field(default="truncate", metadata=aliases(
        verl("algorithm.rollout_is_mode"),
        verl("algorithm.rollout_correction.rollout_rs", same_value=False,
             note="veRL's rejection sampling is rollout_is_mode=mask: rollout_rs=token_k1 is rollout_is=token, "
                  "seq_mean_k1 (Geo-RS) is rollout_is=sequence, with the bounds in rollout_is_threshold_lower "
                  "and rollout_is_threshold; a kept token keeps its ratio as its weight")))
    """truncate: a ratio is clipped into [rollout_is_threshold_lower, rollout_is_threshold]
    (TIS). mask: a ratio outside them gives weight 0, one inside is its own weight (IcePop,
    MIS); at the sequence level the bounds are on the geometric mean of the token ratios."""
    rollout_is_threshold: float = field(default=2.0, metadata=aliases(
        trl("vllm_importance_sampling_clip_max"), trl("vllm_importance_sampling_cap"),
        verl("algorithm.rollout_correction.rollout_is_threshold"), verl("algorithm.rollout_is_threshold")))
    """C_high: the upper bound of a weight (veRL 2.0, TRL 3.0)."""
    rollout_is_threshold_lower: float | None = field(default=None, metadata=aliases(
        trl("vllm_importance_sampling_clip_min"), verl("algorithm.rollout_is_threshold_lower"),
        verl("algorithm.rollout_correction.rollout_rs_threshold", same_value=False,
             note="a lower_upper string is rollout_is_threshold_lower and rollout_is_threshold")))
    """C_low: the lower bound (null = none: 0)."""
    bypass_mode: bool = field(default=False, metadata=aliases(verl("algorithm.rollout_correction.bypass_mode")))
    """Old log-probs := the engine's, with no recompute pass (veRL's bypass mode with its
    ppo_clip loss): the PPO ratio π_θ / π_rollout then carries the correction, clipped as
    usual, even on an on-policy update. No rollout_corr/* metrics (nothing to compare with);
    the update's first approx_kl compares the actor with the engine. Not with rollout_is."""

    def validate(self) -> None:
        key = "algorithm.rollout_correction"
        check(self.rollout_is_threshold > 0, f"{key}.rollout_is_threshold", f"must be > 0, got {self.rollout_is_threshold}")
        low = self.rollout_is_threshold_lower
        check(low is None or 0 <= low < self.rollout_is_threshold, f"{key}.rollout_is_threshold_lower",
              f"must be in [0, rollout_is_threshold={self.rollout_is_threshold}), got {low}")
        check(not (self.bypass_mode and self.rollout_is), f"{key}.bypass_mode",
              "bypass mode makes the old log-probs the engine's, so every weight would be 1: the PPO ratio "
              "π_θ / π_rollout is the correction there. Set rollout_is=null, or bypass_mode=false for the weights")

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Weights or bypass mode read the engine's log-probs."""
        return self.rollout_is is not None or self.bypass_mode


@dataclass
class AlgorithmConfig(RefSyncConfig):
    """Advantages, KL, the DAPO data tricks and the rollout correction."""

    adv_estimator: AdvEstimatorName = field(default="grpo", metadata=ADV_ESTIMATOR_ALIASES)
    """gae (PPO: critic + GAE), grpo (group-normalised), dr_grpo (group mean only), rloo
    (leave-one-out baseline), reinforce_pp (REINFORCE++: batch-whitened returns)."""
    norm_adv_by_std: Literal["group", "batch", "none"] | None = field(default=None, metadata=aliases(
        trl("scale_rewards", {True: "group", False: "none", "group": "group", "batch": "batch", "none": "none"}),
        verl("algorithm.norm_adv_by_std_in_grpo", {True: "group", False: "none"})))
    """Group estimators' scaling: divide by the group's std, the
    batch's, or not at all; null = group for grpo, none for dr_grpo."""
    gamma: float = field(default=1.0, metadata=aliases(trl("gamma"), verl("algorithm.gamma"), openrlhf("gamma")))
    """Discount γ (gae, reinforce_pp)."""
    lam: float = field(default=0.95, metadata=aliases(trl("lam"), verl("algorithm.lam"), openrlhf("lambd")))
    """GAE λ (TRL 0.95; veRL 1.0)."""
    whiten_advantages: bool | None = None
    """Whiten advantages over the batch's valid tokens; null = on for gae, off otherwise
    (reinforce_pp always whitens, as its definition does)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL to the reference policy."""
    filter_groups: bool = field(default=False, metadata=aliases(
        verl("algorithm.filter_groups.enable"), openrlhf("dynamic_filtering")))
    """DAPO dynamic sampling: drop groups whose scores are all equal and generate more
    prompts until data.train_batch_size groups are kept."""
    max_gen_batches: int = field(default=10, metadata=aliases(verl("algorithm.filter_groups.max_num_gen_batches")))
    """Dynamic sampling gives up after this many generation rounds per step and trains on
    what it kept (with a warning; metrics dynamic_sampling/*)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """Soft overlong punishment."""
    mask_truncated_completions: bool = field(default=False, metadata=aliases(trl("mask_truncated_completions")))
    """Leave truncated responses out of the loss (DAPO's overlong filtering)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights for the engine–trainer log-prob gap (TIS, IcePop, MIS), bypass mode."""

    def validate(self) -> None:
        self.check_ref_sync()
        check(not (self.ref_sync_steps and not self.kl.enabled), "algorithm.ref_sync_steps",
              "there is no reference to sync without a KL term: set algorithm.kl.in_loss=true or in_reward=true")
        check(self.max_gen_batches >= 1, "algorithm.max_gen_batches", "must be >= 1")
        check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma", "gamma and lam must be in [0, 1]")
        check(self.overlong.buffer >= 0, "algorithm.overlong.buffer", "must be >= 0")
        fixed = self.estimator.scale
        check(fixed is None or self.norm_adv_by_std in (None, fixed), "algorithm.norm_adv_by_std",
              f"{self.adv_estimator} is defined with norm_adv_by_std={fixed}; leave it null or {fixed}")
        check(not (self.estimator.whitens and self.whiten_advantages is False),
              "algorithm.whiten_advantages", f"{self.adv_estimator} always whitens; leave it null or true")
        if self.kl.in_reward and self.kl.in_loss:
            log.warning("algorithm.kl: both in_reward and in_loss are on: the KL is penalised twice "
                        "(veRL allows it too); usually one is meant")

    @property
    def estimator(self) -> AdvEstimator:
        """The `posttrain.algos.ADV_ESTIMATORS` entry of adv_estimator."""
        return ADV_ESTIMATORS[self.adv_estimator]

    @property
    def grpo_scale(self) -> str:
        if self.norm_adv_by_std is not None:
            return self.norm_adv_by_std
        return self.estimator.scale or "group"

    @property
    def whiten(self) -> bool:
        if self.whiten_advantages is not None:
            return self.whiten_advantages
        return self.estimator.needs_values  # a critic's advantages have its scale: TRL, veRL whiten them


@dataclass
class PPOAlgorithmConfig(AlgorithmConfig):
    """PPO's algorithm section: GAE by default."""

    adv_estimator: AdvEstimatorName = field(default="gae", metadata=ADV_ESTIMATOR_ALIASES)
    """gae (PPO: critic + GAE), grpo, dr_grpo, rloo or reinforce_pp (see `posttrain grpo`)."""
