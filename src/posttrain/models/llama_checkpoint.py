"""The Hugging Face checkpoint format of the decoders BuiltinLM implements: config.json
fields and weight files.

Architectures (config.json `model_type`, see ARCHITECTURES): Llama; Qwen2/Qwen2.5 (bias on
q/k/v); Qwen3 (RMSNorm of each query and key head before RoPE; head_dim need not be H/nh);
Mistral (Llama's layers). Sliding-window attention (Mistral v0.1, Qwen with
use_sliding_window) is not implemented: a window shorter than max_position_embeddings is
refused by name (`unsupported_features`), never ignored.

Works on plain dicts and tensors (no model classes), so that `builtin.py` (the
model) and `loading.py` (choosing an implementation) share one reading of a
checkpoint. Defaults for missing config.json fields are those of the transformers 5
config class of the model_type (`DEFAULTS`), so a checkpoint means the same thing here
as in transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
"""The config.json `model_type`s BuiltinLM implements, and the transformers class of each."""
_LLAMA_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
)
_QWEN_DEFAULTS = dict(
    _LLAMA_DEFAULTS, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
    max_position_embeddings=32768, bos_token_id=None, eos_token_id=None,
)
DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "qwen2": _QWEN_DEFAULTS,
    "qwen3": dict(_QWEN_DEFAULTS, head_dim=128),
    "mistral": dict(_LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072),
}
"""Sizes and ids transformers 5's config class of each model_type assumes when config.json
omits them (`LlamaConfig`, `Qwen2Config`, `Qwen3Config`, `MistralConfig`)."""
BIAS_FLAGS = {"llama": ("attention_bias", "mlp_bias"), "qwen2": (), "qwen3": ("attention_bias",), "mistral": ()}
"""The config.json bias switches each model_type's transformers class reads (all refused:
Qwen2's fixed q/k/v bias is BuiltinConfig.qkv_bias, not a switch)."""
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config_json(path: str | Path) -> dict:
    """config.json of the checkpoint directory `path`, with a clear error if absent."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist or is not a directory")
    config_file = path / "config.json"
    if (path / "adapter_config.json").is_file() and not config_file.is_file():
        merged = path.parent / f"{path.name}-merged"
        raise FileNotFoundError(
            f"model path {str(path)!r} is a LoRA adapter (adapter_config.json, no config.json), not a "
            f"whole model: merge it into its base first, `posttrain export {path} --merge-lora --out "
            f"{merged}`, and use {merged}"
        )
    if not config_file.is_file():
        names = sorted(p.name for p in path.iterdir())
        held = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") if names else "nothing"
        raise FileNotFoundError(
            f"model path {str(path)!r} has no config.json (expected a Hugging Face model directory; "
            f"it holds {held})"
        )
    return json.loads(config_file.read_text())


def rope_settings(hf: dict) -> tuple[str, float, dict, str]:
    """(rope type, theta, rope dict, name of the field it came from), read from the
    transformers 5 `rope_parameters` or the older top-level `rope_theta` + `rope_scaling`."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(field) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return rope_type, float(theta), params, field


def unsupported_features(hf: dict) -> list[str]:
    """Reasons why BuiltinLM cannot reproduce this checkpoint exactly (empty list: it can)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        return [f"model_type={model_type!r} (BuiltinLM loads {', '.join(map(repr, ARCHITECTURES))})"]
    problems = []
    for flag in BIAS_FLAGS[model_type]:
        if hf.get(flag):
            problems.append(f"{flag}=true (BuiltinLM's {model_type} has no such bias)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (BuiltinLM uses 'silu')")
    rope_type, _, params, field = rope_settings(hf)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(
            f"{field}.rope_type={rope_type!r} "
            f"(BuiltinLM supports {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS[:3] if k not in params]
        if missing:
            problems.append(f"{field} lacks {missing} for rope_type 'llama3'")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial} (BuiltinLM rotates the full head)")
    window = sliding_window(hf)
    max_pos = hf.get("max_position_embeddings", DEFAULTS[model_type]["max_position_embeddings"])
    if window is not None and window < max_pos:
        problems.append(
            f"sliding_window={window} < max_position_embeddings={max_pos} (BuiltinLM has no "
            "sliding-window attention; its results would differ past the window)"
        )
    return problems


def sliding_window(hf: dict) -> int | None:
    """The attention window transformers applies to some layer of this checkpoint, or None.

    Mistral: `sliding_window` (every layer). Qwen2/Qwen3: `sliding_window` only with
    `use_sliding_window`, on the layers `layer_types` marks "sliding_attention" (by default
    those from `max_window_layers` on).
    """
    model_type = hf.get("model_type")
    if model_type == "mistral":
        return hf.get("sliding_window", 4096)
    window = hf.get("sliding_window", 4096)
    if model_type not in ("qwen2", "qwen3") or not hf.get("use_sliding_window") or window is None:
        return None
    layers = hf.get("num_hidden_layers", 32)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(layers)
    ]
    return window if "sliding_attention" in types else None


def builtin_fields(hf: dict) -> dict:
    """BuiltinConfig keyword arguments for a config.json dict of an ARCHITECTURES model_type
    (missing fields take the transformers defaults of that type, `DEFAULTS`)."""
    model_type = hf.get("model_type", "llama")
    hf = {**DEFAULTS[model_type], **hf}
    rope_type, theta, params, _ = rope_settings(hf)
    max_pos = hf["max_position_embeddings"]
    scaling = None
    if rope_type == "llama3":
        scaling = {k: params[k] for k in LLAMA3_ROPE_KEYS[:3]}
        scaling["original_max_position_embeddings"] = params.get(
            "original_max_position_embeddings", max_pos
        )
    return {
        "model_type": model_type,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": hf["num_attention_heads"],
        "num_key_value_heads": hf["num_key_value_heads"],
        "head_dim": hf["head_dim"],
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "initializer_range": hf.get("initializer_range", 0.02),
        "bos_token_id": hf["bos_token_id"],
        "eos_token_id": hf["eos_token_id"],
        "pad_token_id": hf.get("pad_token_id"),
    }


def hf_config_json(fields: dict, dtype: torch.dtype) -> dict:
    """config.json dict (the transformers 5 layout of `fields["model_type"]`) for BuiltinConfig
    fields `fields`. Sliding windows are written off, since BuiltinLM attends to every key."""
    model_type = fields["model_type"]
    rope = {"rope_theta": fields["rope_theta"], "rope_type": "default"}
    if fields["rope_scaling"] is not None:
        rope = {**rope, "rope_type": "llama3", **fields["rope_scaling"]}
    config = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "attention_dropout": 0.0,
        "bos_token_id": fields["bos_token_id"],
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": fields["eos_token_id"],
        "head_dim": fields["head_dim"],
        "hidden_act": "silu",
        "hidden_size": fields["hidden_size"],
        "initializer_range": fields["initializer_range"],
        "intermediate_size": fields["intermediate_size"],
        "max_position_embeddings": fields["max_position_embeddings"],
        "num_attention_heads": fields["num_attention_heads"],
        "num_hidden_layers": fields["num_hidden_layers"],
        "num_key_value_heads": fields["num_key_value_heads"],
        "pad_token_id": fields["pad_token_id"],
        "rms_norm_eps": fields["rms_norm_eps"],
        "rope_parameters": rope,
        "tie_word_embeddings": fields["tie_word_embeddings"],
        "use_cache": True,
        "vocab_size": fields["vocab_size"],
    }
    layers = fields["num_hidden_layers"]
    extra = {
        "llama": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
        "qwen2": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
                  "layer_types": ["full_attention"] * layers},
        "qwen3": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                  "max_window_layers": layers, "layer_types": ["full_attention"] * layers},
        "mistral": {"sliding_window": None},
    }
    return {**config, **extra[model_type]}


def sequence_classifier(model_type: str) -> str:
    """The transformers reward-model class of a family: "qwen3" -> "Qwen3ForSequenceClassification"."""
    return ARCHITECTURES[model_type].removesuffix("ForCausalLM") + "ForSequenceClassification"


def generation_config_json(fields: dict) -> dict:
    """generation_config.json as transformers writes it next to config.json."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: fields[k] for k in keys if fields[k] is not None}


def checkpoint_dtype(hf: dict) -> torch.dtype | None:
    """The dtype config.json says the weights were saved in (None when unknown)."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return DTYPE_NAMES.get(name) if isinstance(name, str) else None


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: single or sharded safetensors, else PyTorch .bin."""
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            return [path / name for name in sorted(set(weight_map.values()))]
    raise FileNotFoundError(
        f"no weights in {str(path)!r}: expected model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json"
    )


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint at `path`, on CPU, as stored."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in weight_files(Path(path)):
        if file.suffix == ".safetensors":
            state.update(load_file(file, device="cpu"))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


def weight_names(path: str | Path) -> set[str]:
    """The names of the checkpoint's tensors, read without loading them (a .bin is memory-mapped)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in weight_files(Path(path)):
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as f:
                names.update(f.keys())
        else:
            names.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
    return names


def architecture(hf: dict) -> str | None:
    """The model class config.json names (`architectures[0]`), e.g. "LlamaForCausalLM"."""
    names = hf.get("architectures") or []
    return names[0] if names and isinstance(names[0], str) else None


def write_checkpoint(
    path: str | Path, state: dict[str, torch.Tensor], config: dict, generation: dict
) -> None:
    """Write config.json, generation_config.json and model.safetensors into `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
