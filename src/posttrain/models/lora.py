"""LoRA through `peft`: wrap a model with adapters, and merge them for export."""

from __future__ import annotations

import copy
import logging
from typing import Any

from torch import nn

from posttrain.config import ConfigError, LoraConfig
from posttrain.models.builtin import BuiltinLM

logger = logging.getLogger(__name__)

LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap `model` with peft LoRA adapters when `cfg.r > 0`; the base weights are frozen."""
    if cfg.r == 0:
        return model
    import peft

    targets: Any = cfg.target_modules
    if targets == ["all-linear"]:
        # peft cannot tell the output head of a non-transformers module apart: name the Llama linears.
        targets = LLAMA_LINEARS if isinstance(model, BuiltinLM) else "all-linear"
    lora = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets)
    try:
        model = peft.get_peft_model(model, lora)
    except ValueError as err:
        raise ConfigError(f"model.lora.target_modules: {err}") from None
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    logger.info("LoRA r=%d on %s: %d of %d parameters train", cfg.r, targets, n_train, n_all)
    return model


def merged_for_export(model: nn.Module) -> nn.Module:
    """A plain model with the LoRA update folded into its weights (W + α/r·BA); the
    training model is left as it is. Non-LoRA models are returned unchanged."""
    if not is_peft(model):
        return model
    return copy.deepcopy(model).merge_and_unload()
