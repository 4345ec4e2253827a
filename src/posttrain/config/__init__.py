"""Typed configs: one dataclass tree per command, YAML presets, dotted overrides."""

from posttrain.config.core import (
    ConfigError,
    RunStopped,
    build_config,
    field_docs,
    iter_fields,
    save_config,
    to_dict,
)
from posttrain.config.preference import DPOConfig, RMConfig
from posttrain.config.rl import GRPOConfig, PPOConfig, RLConfig
from posttrain.config.sections import (
    DataConfig,
    LoraConfig,
    ModelConfig,
    OfflineTrainerConfig,
    RLModelConfig,
    TrainerConfig,
)
from posttrain.config.sft import SFTConfig, SFTDataConfig, SFTEvalConfig

__all__ = [
    "ConfigError",
    "RunStopped",
    "DPOConfig",
    "DataConfig",
    "GRPOConfig",
    "LoraConfig",
    "ModelConfig",
    "OfflineTrainerConfig",
    "PPOConfig",
    "RLConfig",
    "RLModelConfig",
    "RMConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTEvalConfig",
    "TrainerConfig",
    "build_config",
    "field_docs",
    "iter_fields",
    "save_config",
    "to_dict",
]
