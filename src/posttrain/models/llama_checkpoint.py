"""The Hugging Face Llama checkpoint format: config.json fields and weight files.

Works on plain dicts and tensors (no model classes), so that `builtin.py` (the
model) and `loading.py` (choosing an implementation) share one reading of a
checkpoint. Defaults for missing config.json fields are those of transformers 5
`LlamaConfig`, so a checkpoint means the same thing here as in transformers.
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


def unsupported_llama_features(hf: dict) -> list[str]:
    """Reasons why BuiltinLM cannot reproduce this checkpoint exactly (empty list: it can)."""
    problems = []
    if hf.get("model_type") != "llama":
        problems.append(f"model_type={hf.get('model_type')!r} (BuiltinLM loads 'llama' only)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=true (BuiltinLM has no bias terms)")
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
    return problems


def builtin_fields(hf: dict) -> dict:
    """BuiltinConfig keyword arguments for a Llama config.json dict (LlamaConfig defaults)."""
    rope_type, theta, params, _ = rope_settings(hf)
    max_pos = hf.get("max_position_embeddings", 2048)
    scaling = None
    if rope_type == "llama3":
        scaling = {k: params[k] for k in LLAMA3_ROPE_KEYS[:3]}
        scaling["original_max_position_embeddings"] = params.get(
            "original_max_position_embeddings", max_pos
        )
    return {
        "vocab_size": hf.get("vocab_size", 32000),
        "hidden_size": hf.get("hidden_size", 4096),
        "intermediate_size": hf.get("intermediate_size", 11008),
        "num_hidden_layers": hf.get("num_hidden_layers", 32),
        "num_attention_heads": hf.get("num_attention_heads", 32),
        "num_key_value_heads": hf.get("num_key_value_heads"),
        "head_dim": hf.get("head_dim"),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "initializer_range": hf.get("initializer_range", 0.02),
        "bos_token_id": hf.get("bos_token_id", 1),
        "eos_token_id": hf.get("eos_token_id", 2),
        "pad_token_id": hf.get("pad_token_id"),
    }


def llama_config_json(fields: dict, dtype: torch.dtype) -> dict:
    """config.json dict (transformers 5 LlamaConfig layout) for BuiltinConfig fields `fields`."""
    rope = {"rope_theta": fields["rope_theta"], "rope_type": "default"}
    if fields["rope_scaling"] is not None:
        rope = {**rope, "rope_type": "llama3", **fields["rope_scaling"]}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
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
        "mlp_bias": False,
        "num_attention_heads": fields["num_attention_heads"],
        "num_hidden_layers": fields["num_hidden_layers"],
        "num_key_value_heads": fields["num_key_value_heads"],
        "pad_token_id": fields["pad_token_id"],
        "pretraining_tp": 1,
        "rms_norm_eps": fields["rms_norm_eps"],
        "rope_parameters": rope,
        "tie_word_embeddings": fields["tie_word_embeddings"],
        "use_cache": True,
        "vocab_size": fields["vocab_size"],
    }


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
