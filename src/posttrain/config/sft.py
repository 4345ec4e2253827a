"""The `posttrain sft` config tree (also used to pretrain the built-in model from scratch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.config.aliases import aliases, openrlhf, trl
from posttrain.config.core import check
from posttrain.config.sections import DataConfig, ModelConfig, OfflineTrainerConfig, check_divides


@dataclass
class SFTDataConfig(DataConfig):
    """SFT data: the shared data options plus loss masking and packing."""

    completion_only_loss: bool | None = field(default=None, metadata=aliases(trl("completion_only_loss")))
    """Train only on completion tokens of prompt/completion data; `null` means yes for that format (as TRL)."""
    assistant_only_loss: bool = field(default=False, metadata=aliases(trl("assistant_only_loss")))
    """Train only on assistant turns of conversational data (needs `{% generation %}` marks in the chat template)."""
    dataset_text_field: str = field(default="text", metadata=aliases(trl("dataset_text_field")))
    """The column that holds the text of `text` data: another name is read as `text` (the row's
    other columns are left out)."""
    packing: bool = field(default=False, metadata=aliases(trl("packing"), openrlhf("packing_samples")))
    """Pack several examples into each row of `max_length` tokens (best-fit decreasing); no attention crosses examples."""
    environment_markers: list[str] = field(default_factory=lambda: ["<result>", "</result>"])
    """[start, end]: in string prompt/completion data, each start…end span of a completion is
    an environment's answer (the text tool protocol's results, `posttrain.envs`): tokenized on
    its own, as an episode appends it, and never trained on. [] = train on all of the completion."""

    def validate(self) -> None:
        super().validate()
        check(bool(self.dataset_text_field), "data.dataset_text_field", "must name a column, e.g. text")
        check(self.dataset_text_field == "text" or self.format in ("auto", "text"), "data.dataset_text_field",
              f"names the column of text data, and data.format={self.format}; set data.format=auto (or text)")
        check(len(self.environment_markers) in (0, 2) and all(self.environment_markers), "data.environment_markers",
              f"must be [] or [start, end], got {self.environment_markers}")


@dataclass
class SFTEvalConfig:
    """Held-out evaluation during SFT."""

    task: str | None = None
    """A bundled task name (e.g. arithmetic): also report exact-match accuracy by greedy decoding."""
    max_new_tokens: int = 64
    """Tokens generated per eval prompt when `task` is set."""
    num_examples: int = 500
    """Eval examples used for task accuracy (the first N of data.eval_files)."""
    batch_size: int = field(default=64, metadata=aliases(trl("per_device_eval_batch_size")))
    """Prompts decoded at once during task evaluation."""

    def validate(self) -> None:
        check(self.max_new_tokens > 0, "eval.max_new_tokens", "must be > 0")
        check(self.num_examples > 0, "eval.num_examples", "must be > 0")


@dataclass
class SFTTrainerConfig(OfflineTrainerConfig):
    """The shared optimisation options, in SFT's own run directory."""

    output_dir: str = "runs/sft"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/ are written here. It
    holds one run: each command defaults to its own (runs/sft, runs/rm, runs/dpo, ...)."""


@dataclass
class SFTConfig:
    """Supervised fine-tuning: next-token loss on text, prompt/completion or chat data."""

    command: ClassVar[str] = "sft"  # the `posttrain` command; checkpoints record it (resume checks it)

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Training and eval data."""
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    """Optimisation, logging, checkpoints."""
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
    """Held-out evaluation."""

    def validate(self) -> None:
        check_divides(
            self.data.train_batch_size, "data.train_batch_size",
            self.trainer.micro_batch_size, "trainer.micro_batch_size",
        )
