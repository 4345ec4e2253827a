"""peft adapters as a run saves them: adapter_config.json made loadable by
`peft.AutoPeftModelForCausalLM.from_pretrained` (the checkpoints, `final/` and
`posttrain export` write them through `save_adapter` / `peft_adapter_config`)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

ADAPTER_CONFIG = "adapter_config.json"


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def source_of(model: nn.Module) -> str | None:
    """The folder (or hub name) `model` was loaded from: the `name_or_path` transformers and
    `BuiltinLM.from_pretrained` set, looked up through a peft wrapper; None for a model built
    in memory (transformers gives those "")."""
    base = model.get_base_model() if is_peft(model) else model
    name = base.__dict__.get("name_or_path") or getattr(getattr(base, "config", None), "_name_or_path", None)
    return str(name) if name else None


def peft_adapter_config(config: dict, base: Path | None, classifier: bool) -> dict:
    """adapter_config.json as `peft.AutoPeftModelForCausalLM.from_pretrained(folder)` loads it.

    peft records `auto_mapping` with posttrain's classes (BuiltinLM, ScalarHeadModel) and no
    task type when it wraps a module that is not a transformers model, and the base path as
    it was given (maybe relative to the training's working folder). Here: no auto_mapping,
    `base_model_name_or_path` = `base` made absolute (when known), and `task_type` CAUSAL_LM
    for a causal LM's adapter (`classifier`: a reward model's or critic's, left as it is).
    """
    config = {**config, "auto_mapping": None}
    if base is not None:
        config["base_model_name_or_path"] = str(Path(base).resolve())
    if config.get("task_type") is None and not classifier:
        config["task_type"] = "CAUSAL_LM"
    return config


def save_adapter(model: nn.Module, directory: str | Path) -> None:
    """`model.save_pretrained(directory)` of a peft model (adapter_config.json and
    adapter_model.safetensors), its config made loadable by peft (`peft_adapter_config`): the
    base is the local folder the model was loaded from (None for a fresh built-in model,
    whose base weights exist nowhere else: use the merged model in `final/`)."""
    directory = Path(directory)
    # No embedding copy: the trainers never resize or fully train embeddings, and peft's
    # "auto" check would read the base's config through BuiltinConfig (which cannot) or the Hub.
    model.save_pretrained(directory, save_embedding_layers=False)
    base = source_of(model)
    base_dir = Path(base) if base is not None and (Path(base) / "config.json").is_file() else None
    file = directory / ADAPTER_CONFIG
    config = peft_adapter_config(json.loads(file.read_text()), base_dir, classifier=hasattr(model, "scores"))
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
