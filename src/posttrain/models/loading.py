"""Load a local causal LM, built-in or Hugging Face, and call both the same way.

Nothing here downloads: paths are local directories and every transformers call
passes `local_files_only=True`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from posttrain.models import llama_checkpoint as ckpt
from posttrain.models.builtin import BuiltinLM

logger = logging.getLogger(__name__)

IMPLS = ("auto", "builtin", "hf")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`"auto"` -> CUDA when available, else CPU; anything else -> torch.device(device)."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def is_sharded(model: nn.Module) -> bool:
    """`model` (or a peft model's base) is FSDP2-sharded (`distributed.fsdp.shard_model`)."""
    from torch.distributed.fsdp import FSDPModule

    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(root, FSDPModule)


def device_of(model: nn.Module) -> torch.device:
    """The device of `model`'s first parameter (where its inputs go); of an FSDP2 shard, its
    mesh's device (a shard offloaded to the CPU still computes on the GPU)."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return p.device


def resolve_dtype(
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    *,
    trained: bool = False,
) -> torch.dtype:
    """The weight dtype a model is loaded in.

    `"auto"`: float32 for weights an optimizer updates (`trained=True`: the fp32 master
    copy of mixed precision; the forward runs in bfloat16 under `trainer.precision`),
    else bfloat16 on a CUDA device that supports it, else float32.
    "float32" | "bfloat16" | "float16" (or a torch.dtype) -> that dtype.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if trained:
            return torch.float32
        on_cuda = resolve_device(device or "auto").type == "cuda"
        return torch.bfloat16 if on_cuda and torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in ckpt.DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {list(ckpt.DTYPE_NAMES)}")
    return ckpt.DTYPE_NAMES[dtype]


def load_causal_lm(
    path: str | Path,
    impl: str = "auto",
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
) -> nn.Module:
    """Load the causal LM saved in the local directory `path`.

    impl: "builtin" -> BuiltinLM (Llama, Qwen2, Qwen3 and Mistral checkpoints); "hf" ->
    transformers.AutoModelForCausalLM; "auto" -> builtin when config.json is one of those
    whose every feature BuiltinLM implements, else hf. A reward model (a
    `*ForSequenceClassification` checkpoint) is refused: see `check_causal_lm`.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {IMPLS}")
    hf_config = ckpt.read_config_json(path)  # names the path when it is not a model dir
    check_causal_lm(path, hf_config)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if impl == "auto":
        impl = "hf" if ckpt.unsupported_features(hf_config) else "builtin"
    if impl == "builtin":
        return BuiltinLM.from_pretrained(path, device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device)


def check_causal_lm(path: str | Path, hf_config: dict) -> None:
    """Raise ValueError when config.json says `path` holds a sequence classifier (a reward model
    or critic): loading one as a causal LM would drop its score head and either fail on the
    unexpected `score.weight` (built-in) or give an LM head it never trained (transformers)."""
    arch = ckpt.architecture(hf_config)
    if arch is not None and arch.endswith("ForSequenceClassification"):
        raise ValueError(
            f"{path} is a reward model ({arch}), not a causal LM: it scores text and cannot generate "
            "it. Give a causal LM here (a base model, or an SFT/DPO/RL run's final/); a reward model "
            "goes in reward.model_path"
        )


def disable_dropout(model: nn.Module, name: str = "model") -> int:
    """Switch off every dropout of `model`, in train mode too, and log how many modules had one.

    RL and DPO compare log-probs of the same tokens under two forwards (old vs new policy,
    policy vs reference); dropout makes them differ by noise (a GPT-2 at its default 0.1
    shows KL ≈ 0.04 on an on-policy step, where it is 0). As TRL's `disable_dropout_in_model`,
    each `nn.Dropout` gets p = 0; float attributes named `*dropout` are zeroed as well, since
    Llama and Qwen2 attention pass `self.attention_dropout` to their kernel in train mode.
    The config is left as it is, so a saved checkpoint keeps its dropout for later training.
    Returns the number of modules changed.
    """
    changed = 0
    for module in model.modules():
        hit = isinstance(module, nn.Dropout) and module.p > 0
        if hit:
            module.p = 0.0
        for attr, value in list(vars(module).items()):
            if attr.endswith("dropout") and isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                hit = True
        changed += hit
    if changed:
        logger.info("%s: dropout off in %d modules (p = 0), so its log-probs are deterministic", name, changed)
    return changed


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """`model.gradient_checkpointing`: recompute every decoder layer in the backward pass
    instead of keeping its activations (torch.utils.checkpoint, use_reentrant=False), for a
    BuiltinLM, a transformers model or a `ScalarHeadModel` of either, peft-wrapped or not.

    Loss and gradients are those without it; a training step does about one more forward.
    Non-reentrant checkpointing keeps the gradient path to LoRA weights inside a layer even
    when the layer's input needs no gradient (a frozen embedding), so peft needs nothing more.
    """
    from posttrain.checkpoint.adapters import is_peft
    from posttrain.config import ConfigError

    base = model.get_base_model() if is_peft(model) else model
    enable = checkpointing_method(base)
    if enable is None:
        raise ConfigError(f"model.gradient_checkpointing: {type(base).__name__} has no gradient_checkpointing_enable; "
                          "set model.gradient_checkpointing=false")
    try:
        enable({"use_reentrant": False})
    except ValueError as err:  # transformers: "X does not support activation checkpointing"
        raise ConfigError(f"model.gradient_checkpointing: {err}; set model.gradient_checkpointing=false") from None


def checkpointing_method(model: nn.Module) -> Callable[[dict], None] | None:
    """`model`'s method that turns gradient checkpointing on, called with the kwargs of
    `torch.utils.checkpoint.checkpoint`: transformers >= 5.x names it
    `activation_checkpointing_enable` (the older `gradient_checkpointing_enable` warns),
    BuiltinLM and ScalarHeadModel `gradient_checkpointing_enable`."""
    return getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable", None)


def forward_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (B, T, V) from a BuiltinLM or a Hugging Face causal LM (peft-wrapped or not).

    input_ids (B, T); attention_mask (B, T), 1 = real token; position_ids (B, T).
    HF models run without their generation cache.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(base, BuiltinLM):
        return model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.logits
