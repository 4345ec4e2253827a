"""The `posttrain rm` and `posttrain dpo` config trees (pairwise preference training).

Both read preference data, `prompt`/`chosen`/`rejected` rows (or `chosen`/`rejected` with an
implicit shared prompt; strings or chat messages), and count batches in pairs:

    data.train_batch_size      pairs per optimizer step
    trainer.micro_batch_size   pairs per forward/backward; chosen and rejected of a pair go
                               through one concatenated forward (2 × micro_batch_size rows)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from posttrain.config.aliases import aliases, trl
from posttrain.config.core import check
from posttrain.config.sections import (
    DataConfig,
    ModelConfig,
    OfflineTrainerConfig,
    RefSyncConfig,
    check_divides,
)


@dataclass
class PreferenceDataConfig(DataConfig):
    """Preference pairs: the shared data options plus a prompt length limit."""

    format: Literal["auto", "preference"] = "auto"
    """Preference data: prompt/chosen/rejected, or chosen/rejected with an implicit shared prompt
    (strings or chat messages, as TRL); `auto` checks the columns say so."""
    train_batch_size: int = 32
    """Pairs per optimizer step, across all micro-batches."""
    max_length: int = 1024
    """Longest tokenized prompt + response (TRL's default); longer sequences are cut at the end
    (`truncation=truncate`) or their pair dropped (`drop`), counted in `data/n_truncated`."""
    max_prompt_length: int | None = field(default=None, metadata=aliases(trl("max_prompt_length")))
    """Keep only the last N prompt tokens (TRL's left truncation), counted in
    `data/n_prompt_truncated`; null = no limit besides max_length."""

    def validate(self) -> None:
        super().validate()
        check(
            self.max_prompt_length is None or 0 < self.max_prompt_length < self.max_length,
            "data.max_prompt_length",
            f"must be > 0 and < data.max_length={self.max_length} (room for the response), "
            f"got {self.max_prompt_length}",
        )


@dataclass
class PreferenceEvalConfig:
    """Held-out evaluation: the training metrics on data.eval_files, plus task accuracy."""

    task: str | None = None
    """A bundled task (e.g. arithmetic): also report greedy exact-match accuracy on the eval
    prompts (needs `prompt` and `answer` columns), as `posttrain sft` does."""
    max_new_tokens: int = 64
    """Tokens generated per eval prompt when `task` is set."""
    num_examples: int = 500
    """Eval prompts used for task accuracy (the first N of data.eval_files)."""
    batch_size: int = field(default=64, metadata=aliases(trl("per_device_eval_batch_size")))
    """Prompts decoded at once during task evaluation."""

    def validate(self) -> None:
        check(self.max_new_tokens > 0, "eval.max_new_tokens", "must be > 0")
        check(self.num_examples > 0, "eval.num_examples", "must be > 0")
        check(self.batch_size > 0, "eval.batch_size", "must be > 0")


@dataclass
class RMAlgorithmConfig:
    """The Bradley-Terry loss −log σ(r_c − r_r − margin) + c·(r_c + r_r)²."""

    center_rewards_coefficient: float = field(default=0.0, metadata=aliases(trl("center_rewards_coefficient")))
    """c above (Eisenstein et al. 2023): pulls the scores of
    each pair towards a zero sum; 0 = off (TRL's default None). A `margin` column in the data
    is always used when present (Llama 2)."""

    def validate(self) -> None:
        check(self.center_rewards_coefficient >= 0, "algorithm.center_rewards_coefficient", "must be >= 0")


@dataclass
class RMTrainerConfig(OfflineTrainerConfig):
    """The shared optimisation options, in the reward model's own run directory."""

    output_dir: str = "runs/rm"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/ are written here. It
    holds one run: each command defaults to its own (runs/sft, runs/rm, runs/dpo, ...)."""


@dataclass
class RMConfig:
    """Reward model: a backbone with a scalar head at the last token, trained on preference
    pairs with the Bradley-Terry loss; final/ is the backbone's *ForSequenceClassification
    checkpoint (Llama's for the built-in model) that `posttrain ppo reward.model_path=RUN_DIR/final`
    scores with."""

    command: ClassVar[str] = "rm"  # the `posttrain` command; checkpoints record it (resume checks it)

    model: ModelConfig = field(default_factory=ModelConfig)
    """The backbone: a causal LM (its LM head is replaced by a fresh score head), a saved
    reward model (trained further), or a fresh built-in model (model.init)."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Training and eval pairs."""
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)
    """Optimisation, logging, checkpoints."""
    algorithm: RMAlgorithmConfig = field(default_factory=RMAlgorithmConfig)
    """Loss options."""

    def validate(self) -> None:
        check_divides(
            self.data.train_batch_size, "data.train_batch_size",
            self.trainer.micro_batch_size, "trainer.micro_batch_size",
        )


@dataclass
class DPOAlgorithmConfig(RefSyncConfig):
    """The DPO loss family (as TRL's DPOConfig: beta, loss_type, label_smoothing, rpo_alpha)."""

    beta: float = field(default=0.1, metadata=aliases(trl("beta")))
    """β: the strength of the implicit KL to the reference (TRL default 0.1)."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = field(default="sigmoid", metadata=aliases(trl("loss_type")))
    """sigmoid (DPO), ipo (IPO, on per-token mean log-probs as TRL), hinge (SLiC), robust (rDPO)."""
    label_smoothing: float = field(default=0.0, metadata=aliases(trl("label_smoothing")))
    """Assumed fraction of flipped labels, in [0, 0.5): conservative DPO (sigmoid) or rDPO (robust)."""
    rpo_alpha: float | None = field(default=None, metadata=aliases(trl("rpo_alpha")))
    """Add rpo_alpha × the token-mean NLL of the chosen responses (RPO, Pang et al. 2024); null = off."""
    precompute_ref_log_probs: bool = field(default=False, metadata=aliases(trl("precompute_ref_log_probs")))
    """Compute the reference log-probs of every pair once before training, then train without a
    reference model in memory."""

    def validate(self) -> None:
        check(self.beta > 0, "algorithm.beta", f"must be > 0, got {self.beta}")
        check(0.0 <= self.label_smoothing < 0.5, "algorithm.label_smoothing", "must be in [0, 0.5)")
        check(
            self.label_smoothing == 0.0 or self.loss_type in ("sigmoid", "robust"),
            "algorithm.label_smoothing",
            f"applies to loss_type sigmoid or robust, not {self.loss_type}",
        )
        check(self.rpo_alpha is None or self.rpo_alpha >= 0, "algorithm.rpo_alpha", "must be >= 0")
        self.check_ref_sync()
        check(not (self.ref_sync_steps and self.precompute_ref_log_probs), "algorithm.ref_sync_steps",
              "a synced reference cannot use precomputed log-probs: set one of ref_sync_steps=0 or "
              "precompute_ref_log_probs=false")


@dataclass
class DPOTrainerConfig(OfflineTrainerConfig):
    """The shared optimisation options, with TRL's DPO learning rate, in DPO's own run directory."""

    output_dir: str = "runs/dpo"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/ are written here. It
    holds one run: each command defaults to its own (runs/sft, runs/rm, runs/dpo, ...)."""

    learning_rate: float = 1e-6
    """Peak learning rate (AdamW). 1e-6 is TRL's DPO default, made for pretrained models of
    100M+ parameters; the built-in tiny model needs ~1e-4 (see recipes/dpo_arithmetic.yaml)."""


@dataclass
class DPOConfig:
    """Direct preference optimisation: train a policy on preference pairs against a frozen
    reference (the initial policy; with LoRA, the base with its adapter disabled)."""

    command: ClassVar[str] = "dpo"  # the `posttrain` command; checkpoints record it (resume checks it)

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (usually an SFT checkpoint); its initial weights are the reference."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Training and eval pairs."""
    trainer: DPOTrainerConfig = field(default_factory=DPOTrainerConfig)
    """Optimisation, logging, checkpoints."""
    algorithm: DPOAlgorithmConfig = field(default_factory=DPOAlgorithmConfig)
    """Loss options."""
    eval: PreferenceEvalConfig = field(default_factory=PreferenceEvalConfig)
    """Held-out evaluation."""

    def validate(self) -> None:
        check_divides(
            self.data.train_batch_size, "data.train_batch_size",
            self.trainer.micro_batch_size, "trainer.micro_batch_size",
        )
