"""Build the model and tokenizer a config asks for: a fresh built-in model or a local checkpoint, plus LoRA."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.checkpoint.adapters import source_of
from posttrain.config import ConfigError, ModelConfig
from posttrain.models.builtin import BuiltinLM
from posttrain.models.loading import load_causal_lm, resolve_device, resolve_dtype
from posttrain.models.lora import apply_lora, is_peft

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A folder with none of these holds no tokenizer (as `posttrain export` looks for one)."""


def load_tokenizer(cfg: ModelConfig, model: nn.Module | None = None) -> Any:
    """The tokenizer to train `model` (a module passed in; None: the one `cfg` builds) with.

    In order: `model.tokenizer`; for a module, the folder it was loaded from (its
    `name_or_path`, as TRL takes it; `source_of`); `model.path`; the built-in byte tokenizer,
    which only a built-in model may use (`model.init`, or a `BuiltinLM` made in memory). Any
    other module is refused: its tokenizer is unknown, so the caller must pass it
    (`processing_class=`). Nothing is downloaded (`local_files_only`).
    """
    if cfg.tokenizer is not None:
        return _tokenizer_from(cfg.tokenizer, "model.tokenizer")
    source = source_of(model) if model is not None else None
    if source is not None:
        logger.info("tokenizer: the one in %s, where the model passed in was loaded from", source)
        return _tokenizer_from(source, "processing_class", f"the model passed in was loaded from {source}, but ")
    if cfg.path is not None:  # a folder that is no model gets that error, not a tokenizer's
        from posttrain.models.llama_checkpoint import read_config_json

        try:
            read_config_json(cfg.path)
        except FileNotFoundError as err:
            raise ConfigError(f"model.path: {err}") from None
        return _tokenizer_from(cfg.path, "model.tokenizer")
    from posttrain.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    if model is not None:
        _check_builtin_tokenizer_fits(model, len(tokenizer))
    return tokenizer


def _check_builtin_tokenizer_fits(model: nn.Module, n_tokens: int) -> None:
    """Refuse the built-in tokenizer for a module that is no built-in model, or whose
    embedding has fewer rows than the tokenizer has ids."""
    base = model.get_base_model() if is_peft(model) else model
    builtin = isinstance(base, BuiltinLM) or getattr(base, "is_builtin", False)
    vocab = base.config.vocab_size if builtin else None
    if builtin and vocab >= n_tokens:
        return
    why = (f"its vocabulary ({vocab} ids) is smaller than the built-in tokenizer's ({n_tokens})" if builtin else
           f"it is a {type(base).__name__} built in memory (no name_or_path), and the built-in byte "
           "tokenizer is only for posttrain's built-in models")
    raise ConfigError(f"processing_class: no tokenizer for the model passed in: {why}. Pass its tokenizer "
                      "as processing_class= (or set model.tokenizer=DIR)")


def _tokenizer_from(source: str, key: str, context: str = "") -> Any:
    """AutoTokenizer of the local folder (or cached hub name) `source`; an error naming `key`."""
    from transformers import AutoTokenizer

    fix = "; pass the tokenizer as processing_class= or set model.tokenizer=DIR" if key == "processing_class" else ""
    folder = Path(source)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}: {context}{source} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}){fix}")
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {context}cannot load a tokenizer from {source} (nothing is downloaded): "
                          f"{err}{fix}") from None
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
    # Gradient checkpointing is model.gradient_checkpointing's, one way for every model.
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
