"""A report of runs that are stages of one pipeline (SFT, then RL on its model), each with a
held-out evaluation of its final model: what the page opens with.

    write_report([sft, rl], out, evals=[eval_sft, eval_rl])   # what `posttrain demo` writes

An eval directory is what `posttrain eval` writes: eval.json (`metrics`, `settings`) and
samples.jsonl (one row per completion: prompt, completion, answer, reward, correct, ...).
From them the page shows, first:

- the before/after table: the held-out metrics of the first and the last stage's model,
  with the change;
- the headline plot: held-out accuracy across the pipeline on one axis, each stage's
  steps counted from its own 0, the stages split by a divider and named; the runs' own
  eval points (`eval/accuracy`, a smaller eval set) as markers and the final models'
  held-out accuracy as stars;
- the same held-out prompts before and after: the first and last stage's completions
  joined on the prompt, the ones whose outcome changed first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from posttrain.report.runs import Run

EVAL_FILE, EVAL_SAMPLES_FILE = "eval.json", "samples.jsonl"
ACCURACY = "accuracy"
HEADLINE_PNG = "pipeline-accuracy.png"

# The before/after table: (label, metric, scale, format of a value, format of the change,
# +1 where a higher value is better, else 0: the change is then not coloured).
TABLE_ROWS = (
    ("held-out accuracy", "accuracy", 100, "{:.1f}%", "{:+.1f} pts", +1),
    ("mean reward", "reward/mean", 1, "{:.3f}", "{:+.3f}", +1),
    ("mean length (tokens)", "response_length/mean", 1, "{:.1f}", "{:+.1f}", 0),
    ("truncation rate", "truncation_rate", 100, "{:.1f}%", "{:+.1f} pts", 0),
)


@dataclass
class TableRow:
    """A row of the before/after table, formatted; `better` is +1/-1 when the change is good/bad, else 0."""

    label: str
    before: str
    after: str
    change: str
    better: int


@dataclass
class Eval:
    """An eval directory as the report sees it."""

    path: Path
    metrics: dict[str, float]  # eval.json's `metrics` ({} when absent)
    settings: dict[str, Any]  # eval.json's `settings`
    samples: list[dict[str, Any]]  # samples.jsonl rows, in file order
    notes: list[str] = field(default_factory=list)

    @property
    def n_problems(self) -> int | None:
        n = self.settings.get("num_prompts", self.metrics.get("num_prompts"))
        return int(n) if isinstance(n, (int, float)) else None


def load_eval(path: Path) -> Eval:
    """Read an eval directory; missing or unreadable files are notes."""
    result = Eval(path, {}, {}, [])
    try:
        data = json.loads((path / EVAL_FILE).read_text(encoding="utf-8"))
        result.metrics = {k: float(v) for k, v in data.get("metrics", {}).items() if isinstance(v, (int, float))}
        result.settings = dict(data.get("settings", {}))
    except (OSError, ValueError, AttributeError) as e:
        result.notes.append(f"{path / EVAL_FILE}: not read ({type(e).__name__})")
    try:
        lines = (path / EVAL_SAMPLES_FILE).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        result.notes.append(f"{path / EVAL_SAMPLES_FILE}: not found")
        lines = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            result.samples.append(row)
    return result


def stage_spans(runs: Sequence[Run]) -> list[tuple[float, float]]:
    """(start, steps per axis unit) of each stage on the pipeline's axis: every stage gets the
    same width (1), so a 100-step RL stage after 1000 SFT steps is not squeezed into a tenth
    of the panel. Stage i's step s sits at i + s / last_step."""
    return [(float(i), float(max(run.last_step or 0, 1))) for i, run in enumerate(runs)]


def draw_pipeline_accuracy(runs: Sequence[Run], evals: Sequence[Eval | None]) -> Figure:
    """Held-out accuracy across the pipeline: each stage's eval points, then its final eval (a
    star); the stages side by side, each as wide as the others, each counting its own steps."""
    fig = Figure(figsize=(12.0, 4.2), layout="constrained")
    ax = fig.subplots()
    spans = stage_spans(runs)
    ticks: list[float] = []
    labels: list[str] = []
    top = 0.0
    for i, (run, ev, (start, steps)) in enumerate(zip(runs, evals, spans)):
        color = f"C{i % 10}"
        end = start + 1.0
        if i:
            ax.axvline(start, color="#5b6570", linestyle=":", linewidth=1.2)
        ax.axvspan(start, end, color=color, alpha=0.05, linewidth=0)
        ax.text(start + 0.01 * len(runs), 0.96, run.label, transform=ax.get_xaxis_transform(), ha="left", va="top",
                fontsize=11, fontweight="bold", color=color)
        series = run.metrics.get("eval/" + ACCURACY)
        if series is not None and len(series.steps):
            top = max(top, float(np.nanmax(series.values, initial=0.0)))
            n = _eval_size(run)
            ax.plot(start + series.steps / steps, series.values, color=color, linestyle="--", marker="o",
                    markersize=6, markeredgecolor="white", markeredgewidth=0.8, linewidth=1.4, zorder=3,
                    label=f"{run.label}: evals during training" + (f" ({n} problems)" if n else ""))
        if ev is not None and ACCURACY in ev.metrics:
            n = f", {ev.n_problems} problems" if ev.n_problems else ""
            y = ev.metrics[ACCURACY]
            ax.plot([end], [y], marker="*", markersize=15, color=color, markeredgecolor="black",
                    markeredgewidth=0.6, linestyle="none", zorder=5, label=f"{run.label}: final model, held-out{n}")
            ax.annotate(f"{100 * y:.1f}%", (end, y), textcoords="offset points", xytext=(-8, 9), ha="right",
                        va="bottom", fontsize=10, fontweight="bold", color=color, zorder=6,
                        bbox={"facecolor": "white", "edgecolor": color, "linewidth": 0.6, "pad": 1.5})
            top = max(top, y)
        span = int(run.last_step or 0)
        locator = MaxNLocator(nbins=max(3, round(10 / len(runs))), steps=[1, 2, 2.5, 5, 10], integer=True)
        for t in locator.tick_values(0, span):
            if (t == 0 and not i) or 0.08 <= t / steps <= 0.92:  # no tick label crowding a stage's ends
                ticks.append(start + t / steps)
                labels.append(str(int(t)))
        ticks.append(end)  # a stage's last step; where the next one starts, its 0 too
        labels.append(str(span) if i == len(runs) - 1 else f"{span} | 0")
    ax.set_xticks(ticks, labels)
    ax.set_xlim(-0.01 * len(runs), len(runs) * 1.01)
    upper = min(1.0, 1.25 * top + 0.02)  # room above the highest point for the stage names
    ax.set_ylim(-0.03 * upper, upper)  # a point at 0 shows whole
    ax.set_yticks([t for t in MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(0, upper) if 0 <= t <= upper])
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("step (each stage counts its own steps from 0; the stages are drawn equally wide)", fontsize=9)
    ax.set_ylabel("accuracy", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle("Held-out accuracy across the pipeline", fontsize=12, fontweight="bold")
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", ncol=len(runs), fontsize=8, frameon=False)
    return fig


def _eval_size(run: Run) -> int | None:
    """How many problems the run's own evals score (its config's eval.num_examples)."""
    try:
        tree = yaml.safe_load(run.config_text or "")
    except yaml.YAMLError:
        return None
    section = tree.get("eval") if isinstance(tree, dict) else None
    n = section.get("num_examples") if isinstance(section, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def before_after(evals: Sequence[Eval | None]) -> list[TableRow]:
    """The rows of the before/after table: the first and last stage's held-out metrics, and the change."""
    first, last = evals[0], evals[-1]
    rows = []
    for label, key, scale, value_fmt, change_fmt, higher in TABLE_ROWS:
        a = first.metrics.get(key) if first else None
        b = last.metrics.get(key) if last else None
        if a is None and b is None:
            continue
        before, after = (value_fmt.format(scale * x) if x is not None else "-" for x in (a, b))
        if a is None or b is None:
            rows.append(TableRow(label, before, after, "-", 0))
            continue
        sign = (b > a) - (b < a)
        rows.append(TableRow(label, before, after, change_fmt.format(scale * (b - a)), higher * sign))
    return rows


def correct(row: dict[str, Any]) -> bool | None:
    """Whether a completion was right: its `correct`, else a reward of at least 1."""
    if isinstance(row.get("correct"), bool):
        return row["correct"]
    reward = row.get("reward", row.get("score"))
    return reward >= 1.0 if isinstance(reward, (int, float)) else None


def paired_samples(before: Eval, after: Eval) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The completions of the prompts both evals hold, paired on (prompt, sample_index), in `before`'s order."""
    def key(row: dict[str, Any]) -> tuple[str, Any]:
        return json.dumps(row.get("prompt"), sort_keys=True, ensure_ascii=False), row.get("sample_index", 0)

    later = {key(r): r for r in after.samples}
    return [(r, later[key(r)]) for r in before.samples if key(r) in later]


OUTCOMES = (  # (name, before correct, after correct): the comparison's parts, in the order shown
    ("fixed", False, True),
    ("broken", True, False),
    ("wrong before and after", False, False),
    ("right before and after", True, True),
)


def by_outcome(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, list[tuple[dict, dict]]]:
    """The pairs split by how their outcome changed (see OUTCOMES); unscored pairs are left out."""
    parts: dict[str, list[tuple[dict, dict]]] = {name: [] for name, _, _ in OUTCOMES}
    for a, b in pairs:
        for name, was, now in OUTCOMES:
            if correct(a) is was and correct(b) is now:
                parts[name].append((a, b))
    return parts
