"""Which run a checkpoint belongs to, and whether a new run may use a run directory.

A run directory holds one run. Before a resume loads any weights, `check_resume` compares
the checkpoint's "run" record (`RunRecord`: the command, and the fingerprint of every
setting outside `RESUME_MAY_CHANGE`) with this run's; `claim_run_dir` refuses to start a
new run in a folder that holds another one unless told to replace it (`remove_run`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.checkpoint.files import (
    _TMP_PREFIX,
    CHECKPOINTS,
    FINAL,
    STATE_JSON,
    _json_load,
    _step_dirs,
    _unwrap,
    read_file,
)
from posttrain.config import ConfigError
from posttrain.config.inputs import DESCRIBED_ONLY
from posttrain.config.inputs import SECTION as INPUTS_SECTION
from posttrain.logging.metrics import METRICS_FILE, SAMPLES_FILE, TRACKING_FILE

log = logging.getLogger(__name__)


RESUME_MAY_CHANGE = (
    # where the run is written and how it starts
    "trainer.output_dir", "trainer.resume", "trainer.overwrite",
    # how long it runs (the lr schedule spans trainer.max_steps: it follows a new value)
    "trainer.max_steps", "trainer.num_train_epochs", "trainer.max_time_s", "trainer.max_bad_steps",
    "trainer.save_on_signal",
    # cadences and sinks
    "trainer.save_steps", "trainer.save_total_limit", "trainer.eval_steps", "trainer.logging_steps",
    "trainer.report_to", "trainer.progress",
    # memory only: micro-batches accumulate exactly, so the update does not depend on them
    "trainer.micro_batch_size", "actor.micro_batch_size", "actor.max_tokens_per_micro_batch",
    "critic.micro_batch_size", "rollout.max_batch_size", "rollout.gpu_memory_utilization",
    # the device it runs on, the backend and how many workers (every backend writes the same DCP
    # shards, which reshard on load; W workers give one worker's update), where they are placed,
    # and what happens when a Ray worker dies
    "model.device", "trainer.backend", "trainer.nnodes", "trainer.n_workers_per_node", "placement.*", "ray.*",
    "trainer.collective_timeout_s", "trainer.on_worker_failure", "trainer.max_restarts",
    # held-out evaluation reads the model, it never trains it
    "data.eval_files", "eval.*",
    # how config.yaml describes what the Python API passed: where a function's file is, the
    # type that held the rows (their count and sha256 are the run's data, and must match)
    *DESCRIBED_ONLY,
)
"""The settings a resumed run may change (`section.*` is a whole section). Every other
setting of the command's config tree, the model, tokenizer, data, algorithm, loss, LoRA,
critic, rollout, reward, optimizer and schedule, is the run's fingerprint, which must match
to resume: e.g. model.path/init/impl/dtype, model.tokenizer, model.lora.*, data.train_files,
data.max_length, data.train_batch_size, algorithm.*, critic.enable/share_backbone/model_path,
reward.functions, trainer.learning_rate, trainer.seed, trainer.precision."""

_HOW_IT_STARTS = RESUME_MAY_CHANGE[:3]
"""Not recorded: where this start writes and how it starts are no setting of the run (a run
directory may be moved)."""

BUILT_MODEL = "(built model)"
"""The fingerprint entry of the model the run built: its class, size and parameter shapes
(a model passed to the Python API has no model.path/init to compare)."""


@dataclass
class RunRecord:
    """Which run wrote a checkpoint, kept in its trainer_state.json as "run": the command
    (sft, rm, dpo, grpo, ppo), its fingerprint (the flattened settings that must match to
    resume, and BUILT_MODEL) and its settings in RESUME_MAY_CHANGE (but output_dir, resume
    and overwrite)."""

    command: str
    fingerprint: dict[str, Any]
    settings: dict[str, Any]

    @classmethod
    def of(cls, command: str, config: Mapping[str, Any], model: torch.nn.Module | str) -> RunRecord:
        """The record of a run of `command` configured by `config` (the nested `to_dict` of
        its config tree) that trains `model` (or a model whose `model_signature` is `model`)."""
        flat = json.loads(json.dumps(_flatten(config)))  # as trainer_state.json will hold it
        settings = {k: v for k, v in flat.items() if _may_change(k) and k not in _HOW_IT_STARTS}
        fingerprint = {k: v for k, v in flat.items() if not _may_change(k)}
        fingerprint[BUILT_MODEL] = model if isinstance(model, str) else model_signature(model)
        return cls(command, fingerprint, settings)

    def as_json(self) -> dict[str, Any]:
        return {"command": self.command, "fingerprint": self.fingerprint, "settings": self.settings}

    @classmethod
    def read(cls, checkpoint: Path) -> RunRecord | None:
        """The record in `checkpoint`, or None for one saved before posttrain recorded it."""
        run = read_file(checkpoint / STATE_JSON, _json_load).get("run")
        return None if run is None else cls(run["command"], run["fingerprint"], run["settings"])


def model_signature(model: torch.nn.Module) -> str:
    """"BuiltinLM, 1,234 parameters, shapes 0123456789ab": what a checkpoint's weights must fit."""
    model = _unwrap(model)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]
    return f"{_class_name(model)}, {sum(p.numel() for p in model.parameters()):,} parameters, shapes {digest}"


def _class_name(model: torch.nn.Module) -> str:
    """The model's class, not FSDP2's `FSDP<class>` subclass that `fully_shard` swaps in (the
    shapes of its DTensor parameters are the full ones, so the rest of the signature holds)."""
    cls = type(model)
    if cls.__name__.startswith("FSDP") and cls.__bases__ and cls.__bases__[-1].__name__ == cls.__name__[4:]:
        cls = cls.__bases__[-1]
    return cls.__name__


def check_resume(checkpoint: Path, run: RunRecord, resume: str, max_steps: int) -> list[str]:
    """Refuse, before any weights are loaded, to continue `checkpoint` (found by
    `trainer.resume=resume`) in `run`: it must have been written by the same command with
    the same fingerprint, and not be past `max_steps`. Returns the RESUME_MAY_CHANGE settings
    that changed, as "key: old → new" lines.

    A checkpoint saved before posttrain recorded its run cannot be checked: `auto` refuses
    it, naming it in trainer.resume resumes it with a warning.
    """
    saved = RunRecord.read(checkpoint)
    step = read_file(checkpoint / STATE_JSON, _json_load)["step"]
    where = f"trainer.resume={resume}: {checkpoint}"
    if saved is None and resume == "auto":
        raise ConfigError(f"{where} was saved by an older posttrain that did not record its command and "
                          f"settings, so it cannot be checked against this run. To continue it anyway, name it: "
                          f"trainer.resume={checkpoint}. Otherwise {_start_elsewhere(resume)}.")
    if saved is None:
        log.warning("%s records no command and settings (an older posttrain): resuming it unchecked", checkpoint)
    elif saved.command != run.command:
        raise ConfigError(f"{where} belongs to a `posttrain {saved.command}` run, and this is `posttrain "
                          f"{run.command}`; a run directory holds one run. {_sentence(_start_elsewhere(resume))}.")
    elif mismatched := _changes(saved.fingerprint, run.fingerprint, both_only=True):
        shown = "; ".join(mismatched[:6]) + (f"; and {len(mismatched) - 6} more" if len(mismatched) > 6 else "")
        raise ConfigError(f"{where} belongs to a `posttrain {run.command}` run with other settings "
                          f"(checkpoint → this run): {shown}. These must match to resume (only those in "
                          f"posttrain.checkpoint.RESUME_MAY_CHANGE may change: trainer.max_steps, cadences, "
                          f"sinks, micro-batch sizes, eval). {_sentence(_start_elsewhere(resume))}.")
    if step > max_steps:
        raise ConfigError(f"trainer.max_steps={max_steps}: {checkpoint} (trainer.resume={resume}) is already at "
                          f"step {step}, past the end of this run. Set trainer.max_steps >= {step} to continue it, "
                          f"or {_start_elsewhere(resume)}.")
    if saved is None:
        return []
    return (_changes(_as_rerun(saved.settings, run.settings), run.settings)
            + _changes(_as_rerun(saved.fingerprint, run.fingerprint), run.fingerprint))


def _as_rerun(old: Mapping[str, Any], new: Mapping[str, Any]) -> Mapping[str, Any]:
    """`old` without its record of what the Python API passed (`config.inputs`) when `new`
    has none: a rerun of a Python run from its config.yaml, whose data and reward functions
    are compared under their config keys."""
    prefix = f"{INPUTS_SECTION}."
    if any(k.startswith(prefix) for k in new):
        return old
    return {k: v for k, v in old.items() if not k.startswith(prefix)}


def claim_run_dir(run_dir: str | Path, resume_from: Path | None, resume: str, overwrite: bool) -> None:
    """Make `run_dir` this run's before anything is written to it. Continuing a checkpoint of
    its own needs nothing; a new run (resume=never, auto with nothing to continue, or a
    checkpoint from elsewhere) in a folder that holds another run is refused unless
    `overwrite`, which removes the old run's outputs first.

    A folder holds a run when it has checkpoints, final/ or metrics.jsonl; with resume=auto,
    metrics.jsonl alone (a run that stopped before its first checkpoint) is started over.
    """
    run_dir = Path(run_dir)
    if resume_from is not None and resume_from.resolve().parent == (run_dir / CHECKPOINTS).resolve():
        return
    found = [f"{CHECKPOINTS}/"] if _step_dirs(run_dir / CHECKPOINTS) else []
    found += [f"{FINAL}/"] if (run_dir / FINAL).exists() else []
    if found or resume != "auto":
        found += [METRICS_FILE] if (run_dir / METRICS_FILE).exists() else []
    if not found:
        return
    if not overwrite:
        nothing = "there is no checkpoint in it to continue" if resume == "auto" else f"trainer.resume={resume}"
        raise ConfigError(
            f"trainer.output_dir={run_dir} already holds a run ({', '.join(found)}) and {nothing}: a new run "
            "would mix with it. Write this run to a new trainer.output_dir, or replace the old one with "
            "trainer.overwrite=true (which removes it first)"
            + ("." if resume == "auto" else ", or continue it with trainer.resume=auto.")
        )
    removed = remove_run(run_dir)
    log.info("trainer.overwrite: removed the old run in %s (%s)", run_dir, ", ".join(removed))


RUN_OUTPUTS = (CHECKPOINTS, FINAL, "config.yaml", METRICS_FILE, SAMPLES_FILE, TRACKING_FILE,
               "tensorboard", "wandb", "mlruns", "report.html", "report-*.png", f"{_TMP_PREFIX}*")
"""What a run (and `posttrain report`) writes into its folder: `remove_run` deletes these
and nothing else, so a run directory set to a folder with other files keeps them."""


def remove_run(run_dir: Path) -> list[str]:
    """Delete the RUN_OUTPUTS in `run_dir`; returns the names removed."""
    removed = []
    for pattern in RUN_OUTPUTS:
        for path in sorted(run_dir.glob(pattern)):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
    return removed


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"init": "tiny"}} → {"model.init": "tiny"} (config sections only: a config
    tree has no mapping-typed fields, so every nested mapping is a section)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _may_change(key: str) -> bool:
    return any(key == p or (p.endswith(".*") and key.startswith(p[:-1])) for p in RESUME_MAY_CHANGE)


def _changes(old: Mapping[str, Any], new: Mapping[str, Any], both_only: bool = False) -> list[str]:
    """"key: old → new" for each key whose value differs; a key on one side only (a setting of
    another posttrain version) is listed too unless `both_only`."""
    keys = [k for k in new if k in old] if both_only else list(dict.fromkeys([*old, *new]))
    shown = {k: (json.dumps(old[k]) if k in old else "(not recorded)",
                 json.dumps(new[k]) if k in new else "(no such setting)") for k in keys}
    return [f"{k}: {a} → {b}" for k, (a, b) in shown.items() if a != b]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _start_elsewhere(resume: str) -> str:
    if resume == "auto":
        return ("write this run to a new trainer.output_dir, or replace the old run with "
                "trainer.resume=never trainer.overwrite=true")
    return "name a checkpoint of this run in trainer.resume, or start afresh with trainer.resume=never"
