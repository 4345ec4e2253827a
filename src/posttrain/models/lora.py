"""LoRA through `peft`: wrap a model with adapters, merge them for export, and read a
TRL-style `peft_config` into `model.lora` (saving them as peft loads them:
`checkpoint.adapters`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from torch import nn

from posttrain.checkpoint.adapters import is_peft
from posttrain.config import ConfigError, LoraConfig
from posttrain.models.builtin import BuiltinLM

logger = logging.getLogger(__name__)

LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCORE_HEAD = "score"
"""The scalar head of a reward model / critic (`ScalarHeadModel.score`), trained in full."""


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap `model` with peft LoRA adapters when `cfg.r > 0`; the base weights are frozen.

    The one place every trainer (SFT, RM, DPO, GRPO/PPO, local and Ray) adds adapters, to a
    model it built or one it was given. A causal LM (BuiltinLM or transformers) gets adapters
    on `cfg.target_modules`; a reward model / critic (`ScalarHeadModel`, which has `scores`)
    also trains its score head in full (peft `modules_to_save`, as TRL does for sequence
    classification). `all-linear` never takes the LM or score head. A model that is already
    peft-wrapped is returned as is when `cfg.r == 0` and refused otherwise (a second adapter
    would be silently stacked on the first).
    """
    if cfg.r == 0:
        return model
    if is_peft(model):
        raise ConfigError(
            f"model.lora.r={cfg.r}: the model passed in already has peft adapters; set model.lora.r=0 "
            "(and pass no peft_config) to train them, or pass the base model to add new ones"
        )
    import peft

    scalar_head = hasattr(model, "scores")
    targets: Any = cfg.target_modules
    if targets == ["all-linear"]:
        # peft cannot tell the output head of a non-transformers module apart: name the Llama linears.
        builtin = isinstance(model, BuiltinLM) or getattr(model, "is_builtin", False)
        targets = LLAMA_LINEARS if builtin else "all-linear"
    lora = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                           modules_to_save=[SCORE_HEAD] if scalar_head else None)
    try:
        model = peft.get_peft_model(model, lora)
    except ValueError as err:
        raise ConfigError(f"model.lora.target_modules: {err}") from None
    logger.info("LoRA r=%d on %s: %s", cfg.r, targets, parameter_counts(model))
    return model


def parameter_counts(model: nn.Module) -> str:
    """"N parameters", plus "(M trained)" when some are frozen (LoRA: M counts the adapters)."""
    params = list(model.parameters())
    total, trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    return f"{total:,} parameters" + (f" ({trained:,} trained)" if trained != total else "")


def merged_for_export(model: nn.Module) -> nn.Module:
    """A plain model with the LoRA update folded into its weights (W + α/r·BA); the
    training model is left as it is. Non-LoRA models are returned unchanged."""
    if not is_peft(model):
        return model
    return copy.deepcopy(model).merge_and_unload()


# --- saved adapters --------------------------------------------------------------------


# --- TRL's peft_config -----------------------------------------------------------------

_HONOURED = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}
_LEFT_TO_PEFT = {"peft_type", "peft_version", "task_type", "modules_to_save"}  # checked by kind below


def lora_from_peft(peft_config: Any, current: LoraConfig, model_type: str, classifier: bool = False) -> LoraConfig:
    """`model.lora` for a TRL-style `peft_config=peft.LoraConfig(...)`: r, lora_alpha, lora_dropout
    and target_modules map onto r, alpha, dropout, target_modules of `current` (which keeps its
    `quantize`). target_modules None is peft's default for `model_type` (the checkpoint's,
    e.g. llama: q_proj, v_proj).

    Refused, naming the field: another adapter type, a regex target_modules, a task_type
    other than the trainer's (CAUSAL_LM; SEQ_CLS for a reward model, `classifier`), and any
    other field set away from its peft default (bias, use_dora, modules_to_save, ...): those
    are not applied, and ignoring them would train something else than asked.
    """
    import peft
    from peft.utils.constants import (
        TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS,
    )

    if not isinstance(peft_config, peft.LoraConfig):
        raise ConfigError(f"peft_config: only a peft.LoraConfig is supported, got {type(peft_config).__name__}")
    task = "SEQ_CLS" if classifier else "CAUSAL_LM"
    if peft_config.task_type not in (None, task):
        raise ConfigError(f"peft_config.task_type={peft_config.task_type!r}: this trainer trains a {task} model; "
                          f"set task_type={task!r} or leave it unset")
    saved = peft_config.modules_to_save
    if saved and not (classifier and list(saved) == [SCORE_HEAD]):
        raise ConfigError(f"peft_config.modules_to_save={saved}: not supported"
                          + ("; the score head always trains in full" if classifier else "")
                          + ". Leave it unset")
    default = peft.LoraConfig()
    unhonoured = [f.name for f in dataclasses.fields(peft_config)
                  if f.name not in _HONOURED and f.name not in _LEFT_TO_PEFT
                  and getattr(peft_config, f.name) != getattr(default, f.name)]
    if unhonoured:
        raise ConfigError(
            f"peft_config: {', '.join(unhonoured)} {'is' if len(unhonoured) == 1 else 'are'} not supported "
            "(only r, lora_alpha, lora_dropout, target_modules and task_type are applied); leave "
            f"{'it' if len(unhonoured) == 1 else 'them'} at peft's default, or use model.lora.*"
        )
    targets = peft_config.target_modules
    if targets is None:
        if model_type not in PEFT_TARGETS:
            raise ConfigError(f"peft_config.target_modules: peft has no default for model type {model_type!r}; "
                              "name the layers (e.g. ['q_proj', 'v_proj'] or 'all-linear')")
        targets = list(PEFT_TARGETS[model_type])
    elif isinstance(targets, str):
        if targets != "all-linear":
            raise ConfigError(f"peft_config.target_modules={targets!r}: a regex is not supported; give a list "
                              "of module names or 'all-linear'")
        targets = ["all-linear"]
    else:
        targets = sorted(targets)
    return dataclasses.replace(current, r=peft_config.r, alpha=float(peft_config.lora_alpha),
                               dropout=peft_config.lora_dropout, target_modules=targets)
