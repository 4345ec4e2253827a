"""Checkpoints: atomic save, resume, keep-last-K, and the final HF-format export.

Layout of one checkpoint (`RUN_DIR/checkpoints/step-N/`):

    config.json, model.safetensors, ...   `model.save_pretrained` (HF format; a PEFT
                                          model writes adapter_config.json +
                                          adapter_model.safetensors instead)
    tokenizer.json, ...                   `tokenizer.save_pretrained`
    trainer_state.pt                      optimizer, scheduler, RNG states, data_state, step
    trainer_state.json                    step, metrics, data_state, time (for people), and
                                          "run": the command and settings that wrote it
    COMPLETE                              written last: {"step": N, "files": {name: bytes}}

A checkpoint is written into `checkpoints/.tmp-step-N-<random>/`, COMPLETE is
written last, every file is fsynced, and the folder is renamed to `step-N` in one
`os.rename` (`atomic_dir`, which `final/` and `posttrain export` use too), so a
crash leaves either the whole checkpoint or a `.tmp-*` folder that is ignored and
removed by the next save. A `step-N` folder whose COMPLETE is missing, or whose
files are missing or of another size than COMPLETE records (a truncated copy), is
skipped with a warning when looking for the newest checkpoint.

A run directory holds one run. Before a resume loads any weights, `check_resume` compares
the checkpoint's "run" record (`RunRecord`: the command, and the fingerprint of every
setting outside `RESUME_MAY_CHANGE`) with this run's; `claim_run_dir` refuses to start a
new run in a folder that holds another one unless told to replace it.

trainer_state.pt loads with `torch.load(weights_only=True)`: the data_state a
trainer passes must hold plain Python values (dict, list, str, int, float,
bool, None) and tensors only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from posttrain.config import ConfigError
from posttrain.logging.metrics import METRICS_FILE, SAMPLES_FILE, TRACKING_FILE, jsonable

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
FINAL = "final"
COMPLETE = "COMPLETE"
STATE_PT = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_PREFIX = ".tmp-"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    data_state: dict[str, Any],
    keep: int,
    metrics: dict[str, Any] | None = None,
    run: RunRecord | None = None,
) -> Path:
    """Write `RUN_DIR/checkpoints/step-{step}/` atomically and keep the newest `keep` ones.

    `data_state` is where the data loader stands (e.g. {"epoch": 1, "index": 640}),
    returned as is by `load_checkpoint`. `keep <= 0` keeps every checkpoint.
    `tokenizer` may be None. An existing `step-{step}` is replaced. `run` is recorded in
    trainer_state.json for `check_resume` (the training loop always passes it).
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _remove_temp_dirs(root)
    final = root / f"step-{step}"
    with atomic_dir(final) as tmp:
        _save_pretrained(tmp, model, tokenizer)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": _rng_state(),
            "data_state": data_state,
        }
        torch.save(state, tmp / STATE_PT)
        readable = {
            "step": step,
            "metrics": jsonable(metrics or {}),
            "data_state": jsonable(data_state),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if run is not None:
            readable["run"] = run.as_json()
        (tmp / STATE_JSON).write_text(json.dumps(readable, indent=2) + "\n")
        _seal(tmp, step)
    if keep > 0:
        complete = [p for p in _step_dirs(root) if _incomplete_reason(p) is None]
        for old in complete[:-keep]:
            shutil.rmtree(old)
    return final


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint into existing objects (the optimizer keeps its parameters).

    Loads the weights into `model` in place (see `load_weights`), then the
    optimizer, scheduler and RNG states when given / asked. Returns
    {"step", "data_state", "metrics", "path"}.
    """
    path = Path(path)
    reason = _incomplete_reason(path)
    if reason is not None:
        raise ValueError(f"checkpoint {path} is incomplete: {reason}")
    load_weights(path, model)
    state = torch.load(path / STATE_PT, map_location="cpu", weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        if state["scheduler"] is None:
            raise ValueError(f"checkpoint {path} was saved without a scheduler state")
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng"])
    readable = json.loads((path / STATE_JSON).read_text())
    return {
        "step": state["step"],
        "data_state": state["data_state"],
        "metrics": readable.get("metrics", {}),
        "path": path,
    }


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Copy the safetensors weights saved in `path` into `model`'s own parameters.

    Tied weights: HF saves one tensor of a tied pair (e.g. `model.embed_tokens.weight`
    but not `lm_head.weight`); a key missing from the file is accepted only when its
    parameter shares storage with one that was loaded. Any other missing key, or a
    key the model does not have, is an error. A PEFT model's adapter is loaded
    with `peft.set_peft_model_state_dict`.
    """
    path = Path(path)
    model = _unwrap(model)
    if (path / "adapter_model.safetensors").exists():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise ValueError(f"{path}: adapter keys the model lacks: {result.unexpected_keys[:5]}")
        return
    expected = model.state_dict()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in _weight_files(path):
        tensors = load_file(file)
        unexpected += model.load_state_dict(tensors, strict=False).unexpected_keys
        loaded.update(tensors)
    storage = {name: t.data_ptr() for name, t in expected.items()}
    loaded_storage = {storage[name] for name in loaded if name in storage}
    missing = [k for k in expected if k not in loaded and storage[k] not in loaded_storage]
    if missing or unexpected:
        raise ValueError(
            f"weights in {path} do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def find_latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete `RUN_DIR/checkpoints/step-N`, or None.

    Newer incomplete or corrupt checkpoints are skipped with a warning naming them.
    """
    for path in reversed(_step_dirs(Path(run_dir) / CHECKPOINTS)):
        reason = _incomplete_reason(path)
        if reason is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, reason)
    return None


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint `trainer.resume` asks for: `auto`, `never`, or a path.

    `auto`: the newest complete checkpoint of `run_dir` (None for a fresh run).
    A path may name a checkpoint folder or a run directory (its newest checkpoint).
    """
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest_checkpoint(run_dir)
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"trainer.resume={resume}: no such checkpoint directory {path}")
    if (path / CHECKPOINTS).is_dir():
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(
                f"trainer.resume={resume}: no complete checkpoint in {path / CHECKPOINTS}"
            )
        return latest
    reason = _incomplete_reason(path)
    if reason is not None:
        raise ValueError(f"trainer.resume={resume}: {path} is not a complete checkpoint ({reason})")
    return path


# --- which run a checkpoint belongs to ----------------------------------------------------

RESUME_MAY_CHANGE = (
    # where the run is written and how it starts
    "trainer.output_dir", "trainer.resume", "trainer.overwrite",
    # how long it runs (the lr schedule spans trainer.max_steps: it follows a new value)
    "trainer.max_steps", "trainer.max_time_s", "trainer.max_bad_steps",
    # cadences and sinks
    "trainer.save_steps", "trainer.save_total_limit", "trainer.eval_steps", "trainer.logging_steps",
    "trainer.report_to", "trainer.progress",
    # memory only: micro-batches accumulate exactly, so the update does not depend on them
    "trainer.micro_batch_size", "actor.micro_batch_size", "actor.max_tokens_per_micro_batch",
    "critic.micro_batch_size", "rollout.max_batch_size", "rollout.gpu_memory_utilization",
    # the device it runs on
    "model.device",
    # held-out evaluation reads the model, it never trains it
    "data.eval_files", "eval.*",
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
    def of(cls, command: str, config: Mapping[str, Any], model: torch.nn.Module) -> RunRecord:
        """The record of a run of `command` configured by `config` (the nested `to_dict` of
        its config tree) that trains `model`."""
        flat = json.loads(json.dumps(_flatten(config)))  # as trainer_state.json will hold it
        settings = {k: v for k, v in flat.items() if _may_change(k) and k not in _HOW_IT_STARTS}
        fingerprint = {k: v for k, v in flat.items() if not _may_change(k)}
        fingerprint[BUILT_MODEL] = model_signature(model)
        return cls(command, fingerprint, settings)

    def as_json(self) -> dict[str, Any]:
        return {"command": self.command, "fingerprint": self.fingerprint, "settings": self.settings}

    @classmethod
    def read(cls, checkpoint: Path) -> RunRecord | None:
        """The record in `checkpoint`, or None for one saved before posttrain recorded it."""
        run = json.loads((checkpoint / STATE_JSON).read_text()).get("run")
        return None if run is None else cls(run["command"], run["fingerprint"], run["settings"])


def model_signature(model: torch.nn.Module) -> str:
    """"BuiltinLM, 1,234 parameters, shapes 0123456789ab": what a checkpoint's weights must fit."""
    model = _unwrap(model)
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]
    return f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, shapes {digest}"


def check_resume(checkpoint: Path, run: RunRecord, resume: str, max_steps: int) -> list[str]:
    """Refuse, before any weights are loaded, to continue `checkpoint` (found by
    `trainer.resume=resume`) in `run`: it must have been written by the same command with
    the same fingerprint, and not be past `max_steps`. Returns the RESUME_MAY_CHANGE settings
    that changed, as "key: old → new" lines.

    A checkpoint saved before posttrain recorded its run cannot be checked: `auto` refuses
    it, naming it in trainer.resume resumes it with a warning.
    """
    saved = RunRecord.read(checkpoint)
    step = json.loads((checkpoint / STATE_JSON).read_text())["step"]
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
    return _changes(saved.settings, run.settings) + _changes(saved.fingerprint, run.fingerprint)


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


def save_final(run_dir: str | Path, model: torch.nn.Module, tokenizer: Any) -> Path:
    """Write `RUN_DIR/final/` (model + tokenizer, HF format) atomically, replacing an old one.

    A LoRA model should be merged first (the folder must load in plain transformers).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _remove_temp_dirs(run_dir)
    with atomic_dir(run_dir / FINAL) as tmp:
        _save_pretrained(tmp, model, tokenizer)
    return run_dir / FINAL


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Write a folder that appears at `final` whole or not at all.

    Yields a fresh `.tmp-<name>-*` folder beside `final` to write into. On a clean exit
    every file and folder in it is fsynced, it gets the mode `mkdir` would give it
    (0o777 less the umask: mkdtemp makes it 0o700, private, and checkpoints and exports
    are read by other programs and users), and it is renamed to `final` in one
    `os.rename`; an old `final` is moved aside first and removed only after. On an
    exception the temporary folder is removed and `final` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        yield tmp
        tmp.chmod(0o777 & ~_umask())
        _fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class RunModels:
    """More than one model in one checkpoint or `final/`, for `save_checkpoint` / `save_final`:
    the policy at the top of the folder (HF format, as every trainer), a critic in `critic/`
    (a ScalarHeadModel checkpoint) with its optimizer state in `critic/optimizer.pt`, a LoRA
    adapter in `adapter/`, and a synced reference model in `reference/` (TR-DPO: it is no
    longer the initial policy, so a resume must load it).

    `critic` is a role object with `model`, `optimizer`, `scheduler` and `steps`.
    """

    CRITIC = "critic"
    CRITIC_STATE = "optimizer.pt"
    REFERENCE = "reference"

    def __init__(self, policy: torch.nn.Module, critic: Any = None, adapter: torch.nn.Module | None = None,
                 with_optimizer: bool = True, reference: torch.nn.Module | None = None):
        self.policy, self.critic, self.adapter = policy, critic, adapter
        self.with_optimizer, self.reference = with_optimizer, reference

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        _unwrap(self.policy).save_pretrained(directory)
        if self.adapter is not None:
            self.adapter.save_pretrained(directory / "adapter")
        if self.reference is not None:
            _unwrap(self.reference).save_pretrained(directory / self.REFERENCE)
        if self.critic is None:
            return
        self.critic.model.save_pretrained(directory / self.CRITIC)
        if self.with_optimizer and self.critic.optimizer is not None:
            torch.save({"optimizer": self.critic.optimizer.state_dict(),
                        "scheduler": self.critic.scheduler.state_dict(), "steps": self.critic.steps},
                       directory / self.CRITIC / self.CRITIC_STATE)

    @classmethod
    def load_critic(cls, checkpoint: Path, critic: Any) -> None:
        """Restore the critic's weights (and optimizer, schedule) saved by `save_pretrained`."""
        load_weights(checkpoint / cls.CRITIC, critic.model)
        state_file = checkpoint / cls.CRITIC / cls.CRITIC_STATE
        if critic.optimizer is not None:
            state = torch.load(state_file, map_location="cpu", weights_only=True)
            critic.optimizer.load_state_dict(state["optimizer"])
            critic.scheduler.load_state_dict(state["scheduler"])
            critic.steps = state["steps"]

    @classmethod
    def load_reference(cls, checkpoint: Path, reference: Any) -> None:
        """Restore a synced reference (`reference/`) into `reference.model`; nothing when the
        checkpoint has none (the reference was still the initial policy)."""
        if (checkpoint / cls.REFERENCE).is_dir():
            load_weights(checkpoint / cls.REFERENCE, reference.model)
            reference.synced = True


# --- helpers ---------------------------------------------------------------------------


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under `torch.compile` and DistributedDataParallel wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _save_pretrained(directory: Path, model: torch.nn.Module, tokenizer: Any) -> None:
    _unwrap(model).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _weight_files(path: Path) -> list[Path]:
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    raise FileNotFoundError(f"no model.safetensors (or sharded index) in {path}")


def _step_dirs(root: Path) -> list[Path]:
    """`step-N` folders under `root`, oldest (smallest N) first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a usable checkpoint, or None when it is."""
    marker = path / COMPLETE
    if not marker.is_file():
        return f"no {COMPLETE} marker (the save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"unreadable {COMPLETE} marker"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, expected {size} (truncated?)"
    if STATE_PT not in files:
        return f"{STATE_PT} was not saved"
    return None


def _seal(directory: Path, step: int) -> None:
    """Write the COMPLETE manifest, {"step": N, "files": {relative path: size}}, last
    (`atomic_dir` fsyncs it with the rest before the rename)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    sizes = {p.relative_to(directory).as_posix(): p.stat().st_size for p in files}
    (directory / COMPLETE).write_text(json.dumps({"step": step, "files": sizes}, indent=1, sort_keys=True))


def _fsync_tree(directory: Path) -> None:
    """fsync every file and folder under `directory`, and `directory` itself."""
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    for sub in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        _fsync_dir(sub)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; its rename is durable enough
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask (os.umask only reads it by setting it, so it is set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(tmp: Path, final: Path) -> Path:
    """Rename `tmp` to `final`, replacing an existing `final` folder."""
    old = None
    if final.exists():
        old = final.with_name(f"{_TMP_PREFIX}old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old)
    return final


def _remove_temp_dirs(parent: Path) -> None:
    """Remove `.tmp-*` folders a crashed save left behind."""
    for stale in parent.glob(f"{_TMP_PREFIX}*"):
        if stale.is_dir():
            log.info("removing unfinished save %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    """Python, NumPy, torch and CUDA generator states, in weights_only-loadable types."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "checkpoint has CUDA RNG states for %d devices, this run has %d: not restored",
                len(cuda),
                torch.cuda.device_count(),
            )
