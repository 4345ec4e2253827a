"""Metrics: `RUN_DIR/metrics.jsonl` always, plus TensorBoard, W&B and MLflow when selected.

metrics.jsonl holds one JSON object per logged step, `{"step": N, "<metric>": value, ...}`,
keys in the order they were given. Values are made JSON-safe: 0-dim tensors and NumPy
scalars become numbers, and NaN/±inf become `null` (strict JSON has no NaN; readers
should treat null as "not finite"). The sinks get the raw floats, NaN included.

Resuming: `truncate_after(step)` drops the lines written after the checkpoint's step
from metrics.jsonl and samples.jsonl (each step then appears once), and makes
TensorBoard hide the events after it (`purge_step`). The W&B and MLflow run ids are
kept in `RUN_DIR/tracking.json`, so a resumed run continues the same tracker run;
W&B ignores steps at or below the last one it has seen, with a warning.

Both trackers stay on this machine unless told otherwise: W&B runs offline unless
WANDB_API_KEY or WANDB_MODE is set, and MLflow writes to `RUN_DIR/mlruns` unless
MLFLOW_TRACKING_URI is set. The `tracking` extra installs wandb and mlflow-skinny.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import torch

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TRACKING_FILE = "tracking.json"


def jsonable(value: Any) -> Any:
    """`value` with tensors, NumPy values and paths turned into JSON types; NaN/inf → None."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.dim() == 0 else value.tolist()
    elif isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


def _scalar(value: Any) -> float | None:
    """`value` as a float for the scalar sinks, or None when it is not a single number."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, (bool, int, float, np.integer, np.floating, np.bool_)):
        return float(value)
    return None


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class _Sink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def truncate_after(self, step: int) -> None: ...
    def close(self) -> None: ...


def _summary_writer(directory: Path, purge_step: int | None = None) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(directory, flush_secs=10, purge_step=purge_step)


class _TensorBoard:
    """Scalars into `RUN_DIR/tensorboard/`; the config as a text summary."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any] | None, tracking: dict):
        self.dir = run_dir / "tensorboard"
        self.writer = _summary_writer(self.dir)
        if config:
            text = json.dumps(jsonable(config), indent=2)
            self.writer.add_text("config", f"```\n{text}\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def truncate_after(self, step: int) -> None:
        self.writer.close()  # the new writer hides the events after `step` from TensorBoard
        self.writer = _summary_writer(self.dir, purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


def wandb_mode(environ: Mapping[str, str]) -> str:
    """WANDB_MODE when set, else "online" when WANDB_API_KEY is set, else "offline"."""
    return environ.get("WANDB_MODE") or ("online" if environ.get("WANDB_API_KEY") else "offline")


class _Wandb:
    """A W&B run in `RUN_DIR/wandb/`, named after the run dir, with the config.

    The mode is `wandb_mode(os.environ)`, "offline" by default: the run is then only
    written to `RUN_DIR/wandb/offline-run-*/` (upload it later with `wandb sync`). Offline
    mode is also put in the environment (WANDB_MODE=offline): wandb 0.31 reads it there
    for its own analytics, which otherwise contact the W&B server at exit even when
    `wandb.init(mode="offline")`. The run id is kept in tracking.json and the run is
    started with `resume="allow"`, so a resumed training run continues the same W&B run
    (offline, each start writes a folder of its own with that id). `close` finishes the
    run; W&B's service process (wandb-core) may still be writing the run's last records
    then, and ends with the Python process or at `wandb.teardown()`, which waits for it.
    """

    def __init__(self, run_dir: Path, config: Mapping[str, Any] | None, tracking: dict):
        wandb = _import_tracker("wandb")
        mode = wandb_mode(os.environ)
        if mode == "offline":
            os.environ["WANDB_MODE"] = "offline"
        tracking.setdefault("wandb_run_id", uuid.uuid4().hex[:12])
        self.run = wandb.init(
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "posttrain"),
            name=run_dir.name,
            id=tracking["wandb_run_id"],
            resume="allow",
            mode=mode,
            config=jsonable(config) if config else None,
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def truncate_after(self, step: int) -> None:
        """W&B cannot rewind a run; it drops the repeated steps itself."""

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    """An MLflow run named after the run dir, with the flattened config as params (`a.b`).

    Store: MLFLOW_TRACKING_URI when set (a server, `sqlite:///...`, ...). Otherwise MLflow's
    file store in `RUN_DIR/mlruns`, which needs no server, no database package (it works
    with mlflow-skinny) and no network; view it with `mlflow ui --backend-store-uri
    RUN_DIR/mlruns`. MLflow 3 keeps the file store in maintenance mode and refuses it unless
    MLFLOW_ALLOW_FILE_STORE=true, so that is set for the process when it is unset. The same
    store is chosen on resume whatever is installed, so the run id kept in tracking.json is
    found and that run continues (its params are not logged again: MLflow refuses changes).

    It talks to its store through an `MlflowClient` of its own: MLflow's global state (the
    tracking URI, which `mlflow.set_tracking_uri` also copies into MLFLOW_TRACKING_URI, and
    the active run) is left alone, so runs in one process do not leak into each other.
    Experiment: MLFLOW_EXPERIMENT_NAME, else "posttrain".
    """

    def __init__(self, run_dir: Path, config: Mapping[str, Any] | None, tracking: dict):
        mlflow = _import_tracker("mlflow")
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not self.tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.tracking_uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = mlflow.MlflowClient(self.tracking_uri)
        if "mlflow_run_id" in tracking:
            self.run_id = tracking["mlflow_run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "posttrain")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        tracking["mlflow_run_id"] = self.run_id
        if config:
            params = _flatten(jsonable(config))
            self.client.log_batch(
                self.run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()]
            )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(k, v, now, step) for k, v in scalars.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def truncate_after(self, step: int) -> None:
        """MLflow keeps every logged value; its charts show the latest per step."""

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS: dict[str, type] = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow}


def _import_tracker(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(
            f"trainer.report_to includes {name!r} but {name} is not installed: "
            f"pip install 'posttrain[tracking]' or remove it"
        ) from None


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl and to the sinks named in `report_to`.

    `config` (a nested dict, e.g. the resolved config) is recorded by the sinks that
    keep one. Only the main process of a multi-process run should create one.
    """

    def __init__(
        self,
        run_dir: str | Path,
        report_to: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        unknown = sorted(set(report_to) - set(SINKS))
        if unknown:
            raise ValueError(
                f"trainer.report_to: unknown sink(s) {unknown}; choose from {list(SINKS)}"
            )
        for name in report_to:  # fail on a missing package before any sink starts
            if name != "tensorboard":
                _import_tracker(name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tracking_path = self.run_dir / TRACKING_FILE
        tracking = json.loads(tracking_path.read_text()) if tracking_path.exists() else {}
        self.sinks: list[_Sink] = [
            SINKS[name](self.run_dir, config, tracking) for name in report_to
        ]
        if tracking:
            tracking_path.write_text(json.dumps(tracking, indent=2) + "\n")
        self._metrics = open(self.run_dir / METRICS_FILE, "a")
        self._samples = None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl and send the numbers to the sinks."""
        if "step" in metrics:
            raise ValueError("'step' is reserved in metrics: pass it as the step argument")
        record = {"step": int(step), **jsonable(metrics)}
        self._metrics.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics.flush()
        scalars = {k: x for k, v in metrics.items() if (x := _scalar(v)) is not None}
        for sink in self.sinks:
            sink.log(int(step), scalars)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append one `{"step": step, **row}` line per row to samples.jsonl."""
        if self._samples is None:
            self._samples = open(self.run_dir / SAMPLES_FILE, "a")
        for row in rows:
            self._samples.write(json.dumps({"step": int(step), **jsonable(row)}) + "\n")
        self._samples.flush()

    def truncate_after(self, step: int) -> None:
        """Forget what was logged after `step` (call when resuming from checkpoint `step`)."""
        self._metrics.close()
        _truncate_jsonl(self.run_dir / METRICS_FILE, step)
        self._metrics = open(self.run_dir / METRICS_FILE, "a")
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        _truncate_jsonl(self.run_dir / SAMPLES_FILE, step)
        for sink in self.sinks:
            sink.truncate_after(step)

    def close(self) -> None:
        """Flush and close the files and every sink (safe to call twice)."""
        if self._metrics.closed:
            return
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keep the lines of `path` whose step is <= `step` (and drop a torn last line)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
