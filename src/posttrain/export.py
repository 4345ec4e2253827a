"""Export a checkpoint as a folder that plain `transformers` (and vLLM) load without posttrain.

    posttrain export runs/sft --out exported/sft                      # RUN_DIR -> its final/
    posttrain export runs/sft/checkpoints/step-200 --out exported/s200 --dtype bfloat16
    posttrain export runs/lora/checkpoints/step-50 --out exported/merged --merge-lora
    posttrain export runs/ppo --critic --out exported/critic          # the PPO value model

What CHECKPOINT may name (`resolve_model_dir`):
  - a model folder: config.json + weights (a causal LM, a reward model or a critic), or a
    LoRA adapter (adapter_config.json + adapter_model.safetensors), e.g. `checkpoints/step-N`;
  - a run directory (it has `final/` or `checkpoints/`): its `final/` when that holds a
    model, else its newest complete checkpoint.
  `critic=True` then takes the `critic/` folder inside it (PPO runs save their value model there).

What is written, by the kind read from the folder (`detect_kind`):
  - causal LM (config.json `architectures` ends in `ForCausalLM`, or anything that is not a
    sequence classifier): loaded with `AutoModelForCausalLM` and saved by transformers'
    `save_pretrained`: config.json, model.safetensors, generation_config.json.
  - sequence classifier (`*ForSequenceClassification`: reward models, PPO critics): loaded
    and saved with `AutoModelForSequenceClassification`, so the exported folder gives the
    same scores there (a critic's per-token values are its `logits` at every position).
  - LoRA adapter: with `merge_lora`, the base model (`base`, else adapter_config.json's
    `base_model_name_or_path` when it is a local folder, else the run's `model.path` from
    RUN_DIR/config.yaml) is loaded in float32, the adapter is applied and merged
    (W + alpha/r * B A), and the merged model is saved as above. Without `merge_lora` the
    adapter itself is written (loadable by `peft.PeftModel.from_pretrained(base, OUT)`),
    with `base_model_name_or_path` set to the base when it is known and posttrain's
    `auto_mapping` removed.
  Every kind gets the tokenizer files (from the folder, else the folder above it for
  `critic/` and `adapter/` folders, else the base model's), loaded and re-saved by
  `AutoTokenizer`.

Loading through transformers is the check: a key missing from the checkpoint (which
transformers would silently initialise at random) or of the wrong shape is an error.
Nothing is downloaded: every `from_pretrained` gets a local path and `local_files_only=True`.
The output folder is written next to OUT under a temporary name, fsynced and renamed when
complete (`checkpoint.atomic_dir`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.checkpoint import (
    CHECKPOINTS,
    FINAL,
    atomic_dir,
    find_latest_checkpoint,
    save_tokenizer,
)
from posttrain.checkpoint.adapters import ADAPTER_CONFIG, peft_adapter_config
from posttrain.models.factory import TOKENIZER_FILES
from posttrain.models.llama_checkpoint import DTYPE_NAMES, checkpoint_dtype

log = logging.getLogger(__name__)

CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFIER = "sequence_classifier"
LORA_ADAPTER = "lora_adapter"
CRITIC_DIR = "critic"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Recomputed buffers some checkpoints carry; dropping them loses nothing.
_HARMLESS_UNEXPECTED = ("rotary_emb.inv_freq",)


@dataclass
class ExportResult:
    """What `export_model` wrote."""

    out: Path
    """The exported folder."""
    kind: str
    """CAUSAL_LM, SEQUENCE_CLASSIFIER, or LORA_ADAPTER (an adapter exported without merging)."""
    source: Path
    """The model folder that was exported (CHECKPOINT after resolving run dirs and critic/)."""
    architecture: str | None = None
    """The transformers class that loads `out` (None for an adapter)."""
    base: Path | None = None
    """The base model of a LoRA adapter, when one was used or found."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know (how to load an adapter, a missing tokenizer, ...)."""


def resolve_model_dir(path: str | Path, critic: bool = False) -> Path:
    """The model folder CHECKPOINT names: itself, or a run's final/ or newest checkpoint;
    `critic` then takes its critic/ subfolder. Errors name the path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint, run or model directory")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is a file; expected a checkpoint, run or model directory")
    if not _is_model_dir(path) and _is_run_dir(path):
        path = _run_model_dir(path)
    if critic:
        if not (path / CRITIC_DIR).is_dir():
            raise FileNotFoundError(
                f"{path} has no {CRITIC_DIR}/ folder (only PPO runs with a critic save one)"
            )
        path = path / CRITIC_DIR
    if not _is_model_dir(path):
        raise FileNotFoundError(
            f"nothing loadable in {path}: no config.json (a model) or {ADAPTER_CONFIG} "
            f"(a LoRA adapter), and no {FINAL}/ or {CHECKPOINTS}/ of a run directory"
        )
    return path


def detect_kind(model_dir: Path) -> str:
    """LORA_ADAPTER when adapter_config.json is there, else SEQUENCE_CLASSIFIER or CAUSAL_LM
    by config.json's `architectures`."""
    if (model_dir / ADAPTER_CONFIG).is_file():
        return LORA_ADAPTER
    return (
        SEQUENCE_CLASSIFIER if _is_classifier(_read_json(model_dir / "config.json")) else CAUSAL_LM
    )


def export_model(
    checkpoint: str | Path,
    out: str | Path,
    merge_lora: bool = False,
    base: str | Path | None = None,
    dtype: str | None = None,
    critic: bool = False,
    overwrite: bool = False,
) -> ExportResult:
    """Export CHECKPOINT (see the module docstring) to the folder `out`.

    dtype: "float32" | "bfloat16" | "float16", None keeps the checkpoint's (for a merged
    adapter: the base's). overwrite: replace an existing non-empty `out`.
    """
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(DTYPE_NAMES)}")
    source = resolve_model_dir(checkpoint, critic)
    out = Path(out)
    _check_out(out, source, overwrite)
    kind = detect_kind(source)
    if kind != LORA_ADAPTER and (merge_lora or base is not None):
        raise ValueError(f"{source} is a full model, not a LoRA adapter: drop --merge-lora/--base")
    with atomic_dir(out) as tmp:
        if kind == LORA_ADAPTER:
            result = _export_adapter(source, tmp, merge_lora, base, dtype)
        else:
            result = _export_full(source, tmp, kind, dtype)
        _write_tokenizer(_tokenizer_source(source, result.base), tmp, result)
    result.out = out
    return result


# --- full models -----------------------------------------------------------------------


def _export_full(source: Path, out: Path, kind: str, dtype: str | None) -> ExportResult:
    model = _load_hf(kind, source, DTYPE_NAMES[dtype] if dtype else "auto")
    if kind == SEQUENCE_CLASSIFIER:
        _ensure_pad_token(model, source)
    model.save_pretrained(out)
    return ExportResult(out, kind, source, type(model).__name__)


def _load_hf(kind: str, path: Path, dtype: Any, allow_missing: tuple[str, ...] = ()) -> Any:
    """The transformers model of `path`; an error when a weight is missing or misshapen.

    A causal LM loaded as a classifier (the base of a reward-model adapter) gets one label
    and drops its LM head, as `ScalarHeadModel.from_pretrained` does."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    options: dict[str, Any] = {}
    harmless = _HARMLESS_UNEXPECTED
    cls = AutoModelForCausalLM
    if kind == SEQUENCE_CLASSIFIER:
        cls = AutoModelForSequenceClassification
        if not _is_classifier(_read_json(path / "config.json")):
            options["num_labels"] = 1
            harmless = (*harmless, "lm_head.weight")
    try:
        model, info = cls.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, output_loading_info=True, **options
        )
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"transformers cannot load {path} as {cls.__name__}: {err}") from None
    missing = sorted(k for k in info["missing_keys"] if k not in allow_missing)
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.endswith(harmless))
    mismatched = sorted(str(k) for k in info["mismatched_keys"])
    if missing or unexpected or mismatched:
        raise ValueError(
            f"the weights in {path} do not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {mismatched[:5]}"
        )
    return model.eval()


def _ensure_pad_token(model: Any, source: Path) -> None:
    """transformers pools a classifier's score at the last token that is not pad_token_id;
    without one it refuses batches of more than one row, so the EOS id stands in."""
    config = model.config
    if config.pad_token_id is not None:
        return
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        raise ValueError(f"{source}: config.json has neither pad_token_id nor eos_token_id")
    log.warning("%s has no pad_token_id; writing the EOS id %d", source, eos)
    config.pad_token_id = eos


# --- LoRA adapters ---------------------------------------------------------------------


def _export_adapter(
    source: Path, out: Path, merge: bool, base: str | Path | None, dtype: str | None
) -> ExportResult:
    adapter_config = _read_json(source / ADAPTER_CONFIG)
    if not (source / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{source} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    target = SEQUENCE_CLASSIFIER if _adapts_classifier(adapter_config) else CAUSAL_LM
    base_dir = _find_base(source, adapter_config, base, required=merge)
    if merge:
        return _merge(source, out, target, base_dir, adapter_config, dtype)
    from safetensors.torch import load_file, save_file

    tensors = load_file(source / ADAPTER_WEIGHTS)
    if dtype is not None:
        tensors = {k: v.to(DTYPE_NAMES[dtype]) for k, v in tensors.items()}
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    adapter_config = peft_adapter_config(adapter_config, base_dir, classifier=target == SEQUENCE_CLASSIFIER)
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    note = (
        "a LoRA adapter, not a full model: load it with "
        "peft.PeftModel.from_pretrained(base_model, OUT); export with --merge-lora for a "
        "standalone model"
    )
    if base_dir is None:
        note += "; its base model is unknown (pass --base PATH to record it)"
    return ExportResult(out, LORA_ADAPTER, source, None, base_dir, [note])


def _merge(
    source: Path, out: Path, target: str, base_dir: Path, adapter_config: dict, dtype: str | None
) -> ExportResult:
    """Base (float32) + adapter -> merged weights -> `out` in `dtype` (default: the base's)."""
    import peft
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved_modules = tuple(f"{m}.weight" for m in adapter_config.get("modules_to_save") or ())
    model = _load_hf(target, base_dir, torch.float32, allow_missing=saved_modules)
    base_dtype = checkpoint_dtype(_read_json(base_dir / "config.json")) or torch.float32
    config = peft.PeftConfig.from_pretrained(str(source))
    config.inference_mode = True
    wrapped = peft.get_peft_model(model, config)
    try:
        result = set_peft_model_state_dict(wrapped, load_file(source / ADAPTER_WEIGHTS))
    except RuntimeError as err:  # shapes that do not fit the base
        raise ValueError(
            f"the adapter in {source} does not fit the base {base_dir}: {err}"
        ) from None
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"the adapter in {source} does not fit the base {base_dir}: unexpected "
            f"{result.unexpected_keys[:5]}, missing {missing[:5]}"
        )
    merged = wrapped.merge_and_unload()
    merged.to(DTYPE_NAMES[dtype] if dtype else base_dtype)
    if target == SEQUENCE_CLASSIFIER:
        _ensure_pad_token(merged, source)
    merged.save_pretrained(out)
    return ExportResult(out, target, source, type(merged).__name__, base_dir)


def _find_base(
    source: Path, adapter_config: dict, base: str | Path | None, required: bool
) -> Path | None:
    """The base model folder of an adapter: `base`, else adapter_config.json's
    base_model_name_or_path when it is a local folder, else the run's model.path."""
    if base is not None:
        base = Path(base)
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"--base {base}: not a model directory (no config.json)")
        return base
    named = adapter_config.get("base_model_name_or_path")
    if named and (Path(named) / "config.json").is_file():
        return Path(named)
    run_path = _run_model_path(source)
    if run_path is not None and (run_path / "config.json").is_file():
        return run_path
    if not required:
        return None
    found = f"base_model_name_or_path={named!r} in {source / ADAPTER_CONFIG}"
    if named:
        found += " (not a local model directory; nothing is downloaded)"
    raise FileNotFoundError(
        f"cannot find the base model of the LoRA adapter in {source}: {found}, and no run "
        "config.yaml with a local model.path above it (a run from model.init never saved its "
        "base weights; its final/ holds the merged model). Pass --base PATH"
    )


def _run_model_path(source: Path) -> Path | None:
    """model.path of the run whose config.yaml sits up to three folders above `source`
    (checkpoints/step-N/, final/adapter/, checkpoints/step-N/critic/)."""
    import yaml

    for parent in list(source.resolve().parents)[:3]:
        config = parent / "config.yaml"
        if config.is_file():
            model = (yaml.safe_load(config.read_text()) or {}).get("model") or {}
            path = model.get("path") if isinstance(model, dict) else None
            return Path(path) if path else None
    return None


def _adapts_classifier(adapter_config: dict) -> bool:
    """Whether the adapter was trained on a reward model / critic (a scalar head)."""
    mapping = adapter_config.get("auto_mapping") or {}
    return (
        adapter_config.get("task_type") == "SEQ_CLS"
        or mapping.get("base_model_class") == "ScalarHeadModel"
        or "score" in (adapter_config.get("modules_to_save") or ())
    )


# --- tokenizer, folders ----------------------------------------------------------------


def _tokenizer_source(source: Path, base: Path | None) -> Path | None:
    """The folder to take the tokenizer from: the model's, the one above it (critic/ and
    adapter/ folders sit inside a checkpoint), else the base model's."""
    for folder in (source, source.parent, base):
        if folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES):
            return folder
    return None


def _write_tokenizer(folder: Path | None, out: Path, result: ExportResult) -> None:
    if folder is None:
        result.notes.append(
            f"no tokenizer found next to {result.source}: copy the tokenizer files into the "
            "export before loading it in vLLM"
        )
        return
    from transformers import AutoTokenizer

    save_tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), out)


def _check_out(out: Path, source: Path, overwrite: bool) -> None:
    resolved, src = out.resolve(), source.resolve()
    if resolved == src or resolved in src.parents:
        raise ValueError(f"--out {out} would replace the checkpoint {source} it exports")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} exists and is not empty; pass --overwrite to replace it")


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file()


def _is_run_dir(path: Path) -> bool:
    return (path / FINAL).is_dir() or (path / CHECKPOINTS).is_dir()


def _run_model_dir(run_dir: Path) -> Path:
    if _is_model_dir(run_dir / FINAL):
        return run_dir / FINAL
    latest = find_latest_checkpoint(run_dir)
    if latest is None:
        raise FileNotFoundError(
            f"run directory {run_dir} has no {FINAL}/ model and no complete checkpoint in "
            f"{run_dir / CHECKPOINTS}"
        )
    return latest


def _is_classifier(config: dict) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
