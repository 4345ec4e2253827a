"""Build the model and tokenizer a config asks for: a fresh built-in model or a local checkpoint, plus LoRA."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from posttrain.config import ConfigError, ModelConfig
from posttrain.models.builtin import BuiltinLM
from posttrain.models.loading import load_causal_lm, resolve_device, resolve_dtype
from posttrain.models.lora import apply_lora

logger = logging.getLogger(__name__)



def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer of `model.tokenizer`, else of `model.path`, else the built-in one."""
    source = cfg.tokenizer or cfg.path
    if source is None:
        from posttrain.data.tokenizer import build_tokenizer

        return build_tokenizer()
    if cfg.tokenizer is None:  # a folder that is no model gets that error, not a tokenizer's
        from posttrain.models.llama_checkpoint import read_config_json

        try:
            read_config_json(source)
        except FileNotFoundError as err:
            raise ConfigError(f"model.path: {err}") from None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.tokenizer: cannot load a tokenizer from {source}: {err}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
        logger.info("tokenizer has no pad token; using its eos token %r", tok.eos_token)
    return tok


def build_model(cfg: ModelConfig, tokenizer: Any, *, train: bool = False) -> nn.Module:
    """Load `model.path` or initialise `model.init`, on the configured device and dtype, with LoRA.

    train: an optimizer will update the weights. With `model.dtype=auto` the weights the
    optimizer updates are then float32 (the master copy; `trainer.precision` sets the
    forward's dtype); a frozen LoRA base, or a model that is only run, is bfloat16 on CUDA.
    """
    device = resolve_device(cfg.device)
    dtype = weights_dtype(cfg.dtype, device, trained=train and cfg.lora.r == 0)
    if cfg.init is not None:
        model = BuiltinLM.from_preset(
            cfg.init,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).to(device=device, dtype=dtype)
    elif cfg.path is not None and cfg.lora.quantize != "none":
        model = _load_quantized(cfg, dtype)
    elif cfg.path is not None:
        model = load_causal_lm(cfg.path, impl=cfg.impl, device=device, dtype=dtype)
    else:
        raise ConfigError("model.path: set model.path (a local HF model directory) or model.init (tiny|small)")
    return apply_lora(model, cfg.lora)


def build_model_and_tokenizer(cfg: ModelConfig) -> tuple[nn.Module, Any]:
    """The model (to run, not to train: see `build_model`) and its tokenizer."""
    tokenizer = load_tokenizer(cfg)
    return build_model(cfg, tokenizer), tokenizer


def weights_dtype(dtype: str, device: torch.device, *, trained: bool) -> torch.dtype:
    """`resolve_dtype` for `model.dtype`, logging a warning when the weights an optimizer
    updates (`trained`) come out 16-bit: AdamW then updates them in bfloat16/float16, whose
    8/11-bit mantissa rounds away updates smaller than ~1/256 (bf16) of a weight."""
    resolved = resolve_dtype(dtype, device, trained=trained)
    if trained and resolved in (torch.bfloat16, torch.float16):
        name = str(resolved).removeprefix("torch.")
        logger.warning(
            "model.dtype=%s: the trained weights are %s with no float32 master copy, so small "
            "updates round away. Prefer model.dtype=auto (float32 weights) with "
            "trainer.precision=bf16 (or auto), which runs the forward in bfloat16.",
            name, name,
        )
    return resolved


def _load_quantized(cfg: ModelConfig, dtype: Any) -> nn.Module:
    """QLoRA: the frozen base in 4 or 8 bits through bitsandbytes (CUDA only), ready for adapters."""
    import importlib.util

    if not torch.cuda.is_available():
        raise ConfigError(
            "model.lora.quantize: 4/8-bit base weights (QLoRA) need a CUDA GPU; set model.lora.quantize=none"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("model.lora.quantize: needs bitsandbytes: pip install bitsandbytes")
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        if cfg.lora.quantize == "4bit"
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    model = AutoModelForCausalLM.from_pretrained(
        cfg.path, quantization_config=bnb, dtype=dtype, device_map={"": 0}, local_files_only=True
    )
    return peft.prepare_model_for_kbit_training(model)
