"""Checkpoints: atomic save, resume, keep-last-K, and the final HF-format export.

Layout of one checkpoint (`RUN_DIR/checkpoints/step-N/`):

    config.json, model.safetensors, ...   `model.save_pretrained` (HF format; a PEFT
                                          model writes adapter_config.json +
                                          adapter_model.safetensors instead)
    tokenizer.json, ...                   `tokenizer.save_pretrained`
    trainer_state.pt                      optimizer, scheduler, RNG states, data_state, step
    dcp/                                  data-parallel runs (trainer.strategy ddp|fsdp2): model
                                          and optimizer as torch.distributed.checkpoint shards,
                                          written by every rank (trainer_state.pt then holds
                                          no optimizer); the HF files hold the gathered model
    trainer_state.json                    step, metrics, data_state, time (for people), and
                                          "run": the command and settings that wrote it
    COMPLETE                              written last: {"step": N, "files": {name: bytes},
                                          "crc32": {name: "8 hex digits"}}

A checkpoint is written into `checkpoints/.tmp-step-N-<random>/`, COMPLETE is
written last, every file is fsynced, and the folder is renamed to `step-N` in one
`os.rename` (`atomic_dir`, which `final/` and `posttrain export` use too), so a
crash leaves either the whole checkpoint or a `.tmp-*` folder that is ignored and
removed by the next save. A `step-N` folder whose COMPLETE is missing, or whose
files are missing or of another size than COMPLETE records (a truncated copy), is
skipped with a warning when looking for the newest checkpoint. Before a checkpoint is
resumed or exported, each file's CRC32 is checked against COMPLETE's too (`verify`), so a
damaged file of the right size (a flipped byte, a bad disk or copy) is skipped as well:
`trainer.resume=auto` falls back to the newest checkpoint before it, with a warning saying
which file is damaged; `trainer.resume=PATH` naming it is an error naming the file. (CRC32,
not a cryptographic hash: it guards against accidents, and zlib's reads ~1 GB/s.)
Checkpoints sealed before COMPLETE recorded checksums are checked by size only; a file of
one that fails to load is an error naming it (`CorruptCheckpoint`), not a traceback.

Which run a checkpoint belongs to, and whether a new run may use a folder, is
`checkpoint.runs`.

trainer_state.pt loads with `torch.load(weights_only=True)`: the data_state a
trainer passes must hold plain Python values (dict, list, str, int, float,
bool, None) and tensors only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file

from posttrain.checkpoint.adapters import is_peft, save_adapter
from posttrain.checkpoint.io_errors import io_error
from posttrain.logging.metrics import jsonable

if TYPE_CHECKING:
    from posttrain.checkpoint.runs import RunRecord

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
FINAL = "final"
COMPLETE = "COMPLETE"
STATE_PT = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_PREFIX = ".tmp-"


class CorruptCheckpoint(ValueError):
    """A checkpoint file that cannot be read: the message names it."""


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    data_state: dict[str, Any],
    keep: int,
    metrics: dict[str, Any] | None = None,
    run: RunRecord | None = None,
    write_shards: Callable[[Path], None] | None = None,
) -> Path:
    """Write `RUN_DIR/checkpoints/step-{step}/` atomically and keep the newest `keep` ones.

    `data_state` is where the data loader stands (e.g. {"epoch": 1, "index": 640}),
    returned as is by `load_checkpoint`. `keep <= 0` keeps every checkpoint.
    `tokenizer` may be None. An existing `step-{step}` is replaced. `run` is recorded in
    trainer_state.json for `check_resume` (the training loop always passes it).
    `write_shards(folder)`, when given, writes the optimizer's (and the model's) state
    into the unsealed folder (data-parallel runs: every rank writes its DCP shard there, and
    returns once all have); `optimizer` is then None.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _remove_temp_dirs(root)
    final = root / f"step-{step}"
    with atomic_dir(final) as tmp:
        _save_pretrained(tmp, model, tokenizer)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": _rng_state(),
            "data_state": data_state,
        }
        save_torch(state, tmp / STATE_PT)
        _fault_point(f"save:{step}")  # tests only: a crash halfway through the save
        readable = {
            "step": step,
            "metrics": jsonable(metrics or {}),
            "data_state": jsonable(data_state),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if run is not None:
            readable["run"] = run.as_json()
        (tmp / STATE_JSON).write_text(json.dumps(readable, indent=2) + "\n")
        if write_shards is not None:
            write_shards(tmp)
        _seal(tmp, step)
    if keep > 0:
        complete = [p for p in _step_dirs(root) if _incomplete_reason(p) is None]
        for old in complete[:-keep]:
            shutil.rmtree(old)
    return final


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint into existing objects (the optimizer keeps its parameters).

    Loads the weights into `model` in place (see `load_weights`; None: the caller loads
    them, e.g. from the DCP shards), then the optimizer, scheduler and RNG states when
    given / asked. Returns {"step", "data_state", "metrics", "path"}.
    """
    path = Path(path)
    reason = _incomplete_reason(path)
    if reason is not None:
        raise ValueError(f"checkpoint {path} is incomplete: {reason}")
    if model is not None:
        load_weights(path, model)
    state = read_file(path / STATE_PT, _torch_load)
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"checkpoint {path} holds its optimizer state as DCP shards ({path}/dcp): "
                             "it was written with trainer.strategy=ddp|fsdp2; resume it with one of those")
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        if state["scheduler"] is None:
            raise ValueError(f"checkpoint {path} was saved without a scheduler state")
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng"])
    readable = read_file(path / STATE_JSON, _json_load)
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

        result = set_peft_model_state_dict(model, read_file(path / "adapter_model.safetensors", load_file))
        if result.unexpected_keys:
            raise ValueError(f"{path}: adapter keys the model lacks: {result.unexpected_keys[:5]}")
        return
    expected = model.state_dict()
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in _weight_files(path):
        tensors = read_file(file, load_file)
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
    """The newest complete and intact `RUN_DIR/checkpoints/step-N`, or None.

    Newer incomplete or corrupt checkpoints are skipped with a warning naming them and why
    (the files are checked against COMPLETE's checksums: `verify`).
    """
    for path in reversed(_step_dirs(Path(run_dir) / CHECKPOINTS)):
        reason = _incomplete_reason(path, verify=True)
        if reason is None:
            return path
        log.warning("skipping checkpoint %s: %s; trying the one before it", path, reason)
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
    reason = _incomplete_reason(path, verify=True)
    if reason is not None:
        raise CorruptCheckpoint(f"trainer.resume={resume}: {path} is not a complete checkpoint ({reason}); name "
                                "another checkpoint, or trainer.resume=auto for the newest intact one")
    return path


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
    every file and folder in it is fsynced, gets the mode `open` and `mkdir` would give it
    (0o666 / 0o777 less the umask: mkdtemp makes the folder 0o700 and safetensors its files
    0o600, private, and checkpoints and exports are read by other programs and users), and
    the folder is renamed to `final` in one `os.rename`; an old `final` is moved aside first
    and removed only after. On an exception the temporary folder is removed and `final` is
    left as it was; a write that failed for want of space or permission (however the writer
    reported it: `io_error`) is raised as an OSError naming `final` and the cause.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        yield tmp
        _set_default_modes(tmp)
        _fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = io_error(err)
        if cause is None:
            raise
        raise OSError(cause.errno, f"cannot save {final}: {cause.strerror}") from err


def save_torch(obj: Any, file: Path) -> None:
    """`torch.save(obj, file)` through a Python file, so that a full disk is an OSError(ENOSPC)
    (given a path, torch.save reports it as a RuntimeError that names no cause)."""
    with open(file, "wb") as f:
        torch.save(obj, f)


class RunModels:
    """More than one model in one checkpoint or `final/`, for `save_checkpoint` / `save_final`:
    the policy at the top of the folder (HF format, as every trainer), a critic in `critic/`
    (a ScalarHeadModel checkpoint) with its optimizer state in `critic/optimizer.pt`, a LoRA
    adapter in `adapter/`, and a synced reference model in `reference/` (TR-DPO: it is no
    longer the initial policy, so a resume must load it).

    `critic` is a role object with `model`, `optimizer`, `scheduler` and `steps`, or the value
    model alone (its optimizer state is then saved elsewhere: the RL workers' DCP shards).
    """

    ADAPTER = "adapter"
    CRITIC = "critic"
    CRITIC_STATE = "optimizer.pt"
    REFERENCE = "reference"

    def __init__(self, policy: torch.nn.Module | None, critic: Any = None, adapter: torch.nn.Module | None = None,
                 with_optimizer: bool = True, reference: torch.nn.Module | None = None):
        self.policy, self.critic, self.adapter = policy, critic, adapter
        self.with_optimizer, self.reference = with_optimizer, reference

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        if self.policy is not None:  # None: a critic pool's worker writes critic/ alone
            _save_model(self.policy, directory)
        if self.adapter is not None:
            _save_model(self.adapter, directory / self.ADAPTER)
        if self.reference is not None:
            _unwrap(self.reference).save_pretrained(directory / self.REFERENCE)
        if self.critic is None:
            return
        if isinstance(self.critic, torch.nn.Module):
            self.critic.save_pretrained(directory / self.CRITIC)
            return
        self.critic.model.save_pretrained(directory / self.CRITIC)
        if self.with_optimizer and self.critic.optimizer is not None:
            save_torch({"optimizer": self.critic.optimizer.state_dict(),
                        "scheduler": self.critic.scheduler.state_dict(), "steps": self.critic.steps},
                       directory / self.CRITIC / self.CRITIC_STATE)

    @classmethod
    def load_critic(cls, checkpoint: Path, critic: Any) -> None:
        """Restore the critic's weights (and optimizer, schedule) saved by `save_pretrained`."""
        load_weights(checkpoint / cls.CRITIC, critic.model)
        state_file = checkpoint / cls.CRITIC / cls.CRITIC_STATE
        if critic.optimizer is not None:
            state = read_file(state_file, _torch_load)
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


FAULT_ENV = "POSTTRAIN_FAULT_KILL_AT"
"""Test-only fault injection, not a setting: `save:N` makes the process writing checkpoint
step-N SIGKILL itself halfway through (the weights and trainer_state.pt written, trainer_state.json,
the shards and COMPLETE not), which polling from outside cannot hit reliably
(tests/trainers/test_rl_async_kill.py)."""


def _fault_point(point: str) -> None:
    """SIGKILL this process here when FAULT_ENV names `point` (tests only; unset: nothing)."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


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
    _save_model(model, directory)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)


def _save_model(model: torch.nn.Module, directory: Path) -> None:
    """`save_pretrained`; a peft model's adapter through `save_adapter`, so that peft's
    `AutoPeftModelForCausalLM` loads it (as `posttrain export` writes it)."""
    model = _unwrap(model)
    if is_peft(model):
        save_adapter(model, directory)
    else:
        model.save_pretrained(directory)


LOAD_ONLY_TOKENIZER_KEYS = ("local_files_only", "is_local")
"""What transformers 5 keeps of a tokenizer's loading arguments and writes into its
tokenizer_config.json: how it was loaded, not what it is."""


def save_tokenizer(tokenizer: Any, directory: str | Path) -> None:
    """`tokenizer.save_pretrained(directory)`, without `LOAD_ONLY_TOKENIZER_KEYS` in
    tokenizer_config.json (a copy loaded `local_files_only` would make every later load of the
    saved folder local-only)."""
    tokenizer.save_pretrained(str(directory))
    file = Path(directory) / "tokenizer_config.json"
    if not file.is_file():
        return
    config = json.loads(file.read_text())
    if any(k in config for k in LOAD_ONLY_TOKENIZER_KEYS):
        kept = {k: v for k, v in config.items() if k not in LOAD_ONLY_TOKENIZER_KEYS}
        file.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


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


def read_file(file: Path, read: Callable[[Path], Any]) -> Any:
    """`read(file)`, or a one-line CorruptCheckpoint naming `file` when it is damaged (torch's
    UnpicklingError would advise weights_only=False, which is unsafe; json's names no file).
    Any exception of `read` is the file's: a damaged zip or pickle raises a dozen kinds."""
    try:
        return read(file)
    except Exception as err:
        raise CorruptCheckpoint(f"checkpoint file {file} is damaged and cannot be read ({type(err).__name__}); "
                                "resume from another checkpoint (trainer.resume=PATH) or start afresh") from None


def _torch_load(file: Path) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def _json_load(file: Path) -> Any:
    return json.loads(file.read_text())


def _incomplete_reason(path: Path, verify: bool = False) -> str | None:
    """Why `path` is not a usable checkpoint, or None when it is: COMPLETE is there, and every
    file it lists has its size; with `verify`, its CRC32 too (reads every file)."""
    marker = path / COMPLETE
    if not marker.is_file():
        return f"no {COMPLETE} marker (the save did not finish)"
    try:
        manifest = json.loads(marker.read_text())
        files, crcs = manifest["files"], manifest.get("crc32", {}) if verify else {}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"unreadable {COMPLETE} marker"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, expected {size} (truncated?)"
    if STATE_PT not in files:
        return f"{STATE_PT} was not saved"
    for name, crc in crcs.items():
        if (found := _crc32(path / name)) != crc:
            return f"{name} is damaged (CRC32 {found}, {COMPLETE} recorded {crc})"
    return None


def _crc32(file: Path) -> str:
    """The CRC32 of `file` as 8 hex digits, read in 4 MiB blocks."""
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(4 << 20):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _seal(directory: Path, step: int) -> None:
    """Write the COMPLETE manifest, {"step": N, "files": {relative path: size}, "crc32":
    {relative path: CRC32}}, last (`atomic_dir` fsyncs it with the rest before the rename)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    names = [p.relative_to(directory).as_posix() for p in files]
    manifest = {"step": step, "files": {n: p.stat().st_size for n, p in zip(names, files)},
                "crc32": {n: _crc32(p) for n, p in zip(names, files)}}
    (directory / COMPLETE).write_text(json.dumps(manifest, indent=1, sort_keys=True))


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


def _set_default_modes(directory: Path) -> None:
    """Give `directory` and everything under it the mode a plain `mkdir` / `open` gives:
    0o777 (folders) or 0o666 (files) less the umask; an executable file keeps its x bits."""
    mask = _umask()
    directory.chmod(0o777 & ~mask)
    for path in directory.rglob("*"):
        if path.is_symlink():
            continue
        executable = path.is_dir() or path.stat().st_mode & 0o111
        path.chmod((0o777 if executable else 0o666) & ~mask)


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
