"""posttrain: post-training for language models (SFT, reward models, DPO, online RL)."""

__version__ = "0.1.0"

from posttrain.config import SFTConfig  # noqa: E402
from posttrain.trainers.sft import SFTTrainer  # noqa: E402

__all__ = ["SFTConfig", "SFTTrainer", "__version__"]
