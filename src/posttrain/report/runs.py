"""Reading run directories for the report: metrics.jsonl, samples.jsonl and config.yaml.

Reading is forgiving, because a report is often made of a run that is still going or
that crashed: a torn last line (the trainer was writing it) is skipped, unreadable lines
and rows without an integer `step` are skipped and counted in `Run.notes`, a step logged
twice keeps the later value of each metric (as a resumed run means it), `null` and
non-finite values become NaN (gaps in the plots), and non-numeric values (strings,
lists) are not metrics. A missing samples.jsonl or config.yaml is a note, not an error.

Runs of different kinds of training (SFT, then RL on its model) do not share plots: their
steps count different things. A run's kind is the set of its config's top-level sections
(every RL trainer has `rollout`, `actor`, `critic`, ...; SFT has none of them); `stages`
splits the runs by it. A run without a critic (its `algorithm.adv_estimator` needs no
values) shows none of the critic's metrics, which older runs logged as zeros.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from posttrain.algos import ADV_ESTIMATORS
from posttrain.logging.metrics import METRICS_FILE, SAMPLES_FILE

CONFIG_FILE = "config.yaml"


@dataclass
class Series:
    """One metric of one run: the steps it was logged at and its values there."""

    steps: np.ndarray  # (N,) int, increasing
    values: np.ndarray  # (N,) float, NaN where the value was null or not finite

    def last_finite(self) -> tuple[int, float] | None:
        """(step, value) of the last finite value, or None when there is none."""
        finite = np.flatnonzero(np.isfinite(self.values))
        if not len(finite):
            return None
        i = finite[-1]
        return int(self.steps[i]), float(self.values[i])

    @property
    def n_nonfinite(self) -> int:
        return int((~np.isfinite(self.values)).sum())


@dataclass
class Run:
    """A run directory as the report sees it."""

    path: Path
    label: str  # the name shown in legends and headings
    metrics: dict[str, Series]  # in the order the metrics were first logged
    samples: list[dict[str, Any]]  # samples.jsonl rows, in file order
    config_text: str | None  # config.yaml as written, None when absent
    notes: list[str] = field(default_factory=list)  # what was missing or skipped

    @property
    def last_step(self) -> int | None:
        return max((int(s.steps[-1]) for s in self.metrics.values() if len(s.steps)), default=None)

    @property
    def config(self) -> dict[str, Any] | None:
        """config.yaml as a tree; None without a readable one."""
        try:
            tree = yaml.safe_load(self.config_text) if self.config_text is not None else None
        except yaml.YAMLError:
            return None
        return tree if isinstance(tree, dict) else None

    @property
    def kind(self) -> frozenset[str] | None:
        """The top-level sections of config.yaml; None without a readable one."""
        tree = self.config
        return frozenset(tree) if tree is not None else None


def stages(runs: list[Run]) -> list[list[Run]]:
    """The runs split by kind, in the order each kind first appears (runs without a config
    join the first stage: nothing says they differ)."""
    by_kind: dict[frozenset[str] | None, list[Run]] = {}
    for run in runs:
        kind = run.kind
        if kind is None and by_kind:
            kind = next(iter(by_kind))
        by_kind.setdefault(kind, []).append(run)
    return list(by_kind.values())


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a JSONL file that have an integer `step`, and notes on the lines skipped."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    rows, bad, notes = [], [], []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: the writer was cut off mid-line
                notes.append(f"{path.name}: skipped a partial last line (run in progress or killed)")
            else:
                bad.append(i + 1)
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            bad.append(i + 1)
            continue
        rows.append(row)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        notes.append(f"{path.name}: skipped {len(bad)} unreadable line(s) or line(s) without a step: {shown}")
    return rows, notes


def _number(value: Any) -> float | None:
    """A metric value as a float (NaN for null and non-finite), or None when it is no number."""
    if value is None:
        return math.nan
    if isinstance(value, (bool, int, float)):
        value = float(value)
        return value if math.isfinite(value) else math.nan
    return None


def metric_series(rows: list[dict[str, Any]]) -> dict[str, Series]:
    """Per-metric series from metrics.jsonl rows; a repeated step keeps each metric's later value."""
    by_step: dict[int, dict[str, float]] = {}
    order: dict[str, None] = {}
    for row in rows:
        merged = by_step.setdefault(row["step"], {})
        for key, value in row.items():
            x = _number(value)
            if key != "step" and x is not None:
                merged[key] = x
                order.setdefault(key)
    steps = sorted(by_step)
    series = {}
    for key in order:
        logged = [s for s in steps if key in by_step[s]]
        series[key] = Series(
            np.array(logged, dtype=np.int64), np.array([by_step[s][key] for s in logged], dtype=float)
        )
    return series


def run_labels(paths: list[Path]) -> list[str]:
    """Legend names: each run dir's name, with parent folders added until the names differ."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{label} ({i + 1})" for i, label in enumerate(labels)]  # the same dir given twice


def load_run(path: Path, label: str) -> Run:
    """Read one run directory; FileNotFoundError when it is not one."""
    if not path.is_dir():
        raise FileNotFoundError(f"run directory not found: {path}")
    metrics_path, config_path = path / METRICS_FILE, path / CONFIG_FILE
    if not metrics_path.is_file() and not config_path.is_file():
        raise FileNotFoundError(
            f"{path} is not a run directory: no {METRICS_FILE} or {CONFIG_FILE} "
            "(posttrain training commands write them into trainer.output_dir)"
        )
    run = Run(path, label, {}, [], None)
    if metrics_path.is_file():
        rows, notes = read_jsonl(metrics_path)
        run.metrics = metric_series(rows)
        run.notes += notes
        if not rows:
            run.notes.append(f"{METRICS_FILE} has no complete line yet")
    else:
        run.notes.append(f"no {METRICS_FILE} yet")
    if (path / SAMPLES_FILE).is_file():
        run.samples, notes = read_jsonl(path / SAMPLES_FILE)
        run.notes += notes
    else:
        run.notes.append(f"no {SAMPLES_FILE} (this trainer logs none, or no eval step was reached)")
    if config_path.is_file():
        run.config_text = config_path.read_text(encoding="utf-8", errors="replace")
    else:
        run.notes.append(f"no {CONFIG_FILE}")
    _drop_critic_metrics(run)
    return run


CRITIC_METRICS = ("value_loss", "values/mean", "returns/mean", "critic/*", "timing/values", "timing/update_critic")
"""Metrics only a critic gives (fnmatch patterns, `eval/` twins included)."""


def _drop_critic_metrics(run: Run) -> None:
    """A run whose config names an estimator without a critic (GRPO, RLOO, ...) shows no
    critic metrics: runs logged before they were left out hold them as zeros."""
    algorithm = (run.config or {}).get("algorithm")
    estimator = ADV_ESTIMATORS.get(algorithm.get("adv_estimator")) if isinstance(algorithm, dict) else None
    if estimator is None or estimator.needs_values:
        return
    dropped = [m for m in run.metrics
               if any(fnmatch.fnmatchcase(m.removeprefix("eval/"), p) for p in CRITIC_METRICS)]
    for name in dropped:
        del run.metrics[name]


def load_runs(paths: list[Path]) -> list[Run]:
    """Read several run directories, labelled so that their names differ."""
    return [load_run(p, label) for p, label in zip(paths, run_labels(paths))]
