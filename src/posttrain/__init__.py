"""posttrain: post-training for language models (SFT, reward models, DPO, online RL)."""

__version__ = "0.1.0"

from posttrain.config import DPOConfig, GRPOConfig, PPOConfig, RMConfig, SFTConfig  # noqa: E402
from posttrain.trainers.dpo import DPOTrainer  # noqa: E402
from posttrain.trainers.reward import RewardTrainer  # noqa: E402
from posttrain.trainers.rl import GRPOTrainer, PPOTrainer  # noqa: E402
from posttrain.trainers.sft import SFTTrainer  # noqa: E402

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "PPOConfig",
    "PPOTrainer",
    "RMConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "__version__",
]
