"""The report's plots: one PNG per group of metrics, drawn only when the runs have them.

What is plotted is data: `GROUPS` lists (title, metric names) and a group is drawn when
any run logged any of its metrics, one panel per metric present. Names may be fnmatch
patterns (`logps/*`). A panel for `m` also shows `eval/m`: the train curve as a line,
the eval values (logged only at eval steps) dashed with markers. Several runs share each
panel, one colour per run. A `stacked` group (time per stage) is a stack per step, one
panel per run, since stacks of different runs cannot share axes.

Smoothing, as TensorBoard and W&B draw it: a train series of at least `SMOOTH_MIN_POINTS`
points is drawn as its debiased exponential moving average (`ema`, TensorBoard's scalar
smoothing) with the raw values faint behind it; the weight grows with the series' length
(`ema_weight`: 0.6 for 75 points or fewer, 0.9 from 300 points), and each panel names the weight it
used. Eval values are never smoothed: few, and each one matters, they are drawn as markers.
Schedules (`UNSMOOTHED`: the learning rate, the KL coefficient) are drawn as they are.

Metrics no group names go to "Other metrics" when they vary (at least two distinct
finite values): counters logged once (`data/*`) or constant (`nonfinite_steps`) are left
to the summary table. A new trainer's metrics thus appear without code changes; a group
here only gives them a better place.

Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot, so no global
backend or figure state is touched: safe inside notebooks and threads).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from posttrain.report.runs import Run, Series

EVAL = "eval/"
TIMING_STAGES = (
    "timing/gen", "timing/reward", "timing/old_logprob", "timing/ref", "timing/values",
    "timing/adv", "timing/update_critic", "timing/update_actor",
)
MAX_OTHER_PANELS = 24
PANEL_W, PANEL_H, MAX_COLS = 3.7, 2.7, 3  # inches; the PNGs are 100 dpi
SMOOTH_MIN_POINTS = 20  # shorter series are drawn raw, every point marked
EMA_MIN, EMA_MAX, EMA_SPAN = 0.6, 0.9, 30  # ema_weight(n) = clip(1 - EMA_SPAN / n, EMA_MIN, EMA_MAX)
RAW_ALPHA = 0.25
UNSMOOTHED = ("lr", "*/lr", "kl_coef")  # schedules, not noisy measurements: a moving average would only lag


@dataclass(frozen=True)
class PlotGroup:
    """A figure: its title and the metrics (names or fnmatch patterns) it shows, in order."""

    title: str
    metrics: tuple[str, ...]
    stacked: bool = False  # one stack per step (parts of a whole), else one panel per metric

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.title.lower()).strip("-")


GROUPS: tuple[PlotGroup, ...] = (
    PlotGroup("Reward and accuracy", ("reward/mean", "reward/std", "reward/min", "reward/max", "score/mean", "accuracy")),
    PlotGroup("Loss", ("loss", "perplexity", "policy_loss")),
    PlotGroup("Preference rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "margin")),
    PlotGroup("Log-probabilities", ("logps/*",)),
    PlotGroup("Reward per function", ("reward/*/mean",)),
    PlotGroup("KL and entropy", ("kl", "approx_kl", "entropy", "kl_coef")),
    PlotGroup("Response length and truncation", ("response_length/mean", "response_length/max", "truncation_rate")),
    PlotGroup("Clipping", ("clip_frac", "clip_frac/low", "clip_frac/high", "clip_frac/dual", "ratio/mean")),
    PlotGroup("Advantages and values", ("advantage/mean", "zero_std_group_frac", "value_loss", "values/mean", "returns/mean", "critic/vf_clip_frac")),
    PlotGroup("Learning rate and gradient norm", ("lr", "grad_norm", "critic/lr", "critic/grad_norm")),
    PlotGroup("Time per stage (s)", TIMING_STAGES, stacked=True),
    PlotGroup("Throughput and step time", ("throughput/tokens_per_s", "timing/step", "timing/eval")),
    PlotGroup("Asynchronous RL: staleness and overlap", ("async/staleness/mean", "async/staleness/max",
                                                        "async/dropped_groups", "perf/overlap", "timing/wait_rollout",
                                                        "timing/wait_update")),
)


@dataclass
class Plot:
    """A figure written to disk: what it shows and where the PNG is."""

    title: str
    path: Path
    metrics: list[str]  # base names (without `eval/`) of its panels, or the stacked metrics
    note: str = ""  # e.g. which metrics did not fit
    stage: str = ""  # the runs drawn (labels joined), when the report has several stages


def base_name(metric: str) -> str:
    return metric[len(EVAL):] if metric.startswith(EVAL) else metric


def _present_bases(runs: Sequence[Run]) -> list[str]:
    """Base names of every metric any run logged, in first-logged order."""
    return list(dict.fromkeys(base_name(m) for run in runs for m in run.metrics))


def assign_groups(runs: Sequence[Run]) -> list[tuple[PlotGroup, list[str]]]:
    """The groups to draw, each with the base metric names of its panels (a name joins its first group)."""
    bases = _present_bases(runs)
    taken: set[str] = set()
    chosen = []
    for group in GROUPS:
        names = []
        for pattern in group.metrics:
            hits = [b for b in bases if fnmatch.fnmatchcase(b, pattern) and b not in taken and b not in names]
            if group.stacked:  # stages are train-time metrics; an `eval/` twin does not stack
                hits = [b for b in hits if any(b in run.metrics for run in runs)]
            names += hits
        taken.update(names)
        if names:
            chosen.append((group, names))
    other = [b for b in bases if b not in taken and _varies(runs, b)]
    if other:
        chosen.append((PlotGroup("Other metrics", ()), other))
    return chosen


def _varies(runs: Sequence[Run], base: str) -> bool:
    values = [run.metrics[m].values for run in runs for m in (base, EVAL + base) if m in run.metrics]
    finite = np.concatenate(values)
    return len(np.unique(finite[np.isfinite(finite)])) >= 2


def ema_weight(n: int) -> float:
    """The smoothing weight for a series of `n` points: about 30 points' memory, kept in [0.6, 0.9]."""
    return float(np.clip(1.0 - EMA_SPAN / max(n, 1), EMA_MIN, EMA_MAX))


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's debiased exponential moving average of `values` (N,) → (N,).

        last_i = weight * last_{i-1} + (1 - weight) * x_i,  last_0 = 0
        smoothed_i = last_i / (1 - weight ** k_i)           k_i = finite values so far

    Dividing by (1 - weight^k) removes the pull towards the zero start (as Adam's bias
    correction does), so the curve starts at the first value. NaN values stay NaN and do
    not move the average (a gap in the curve), and a constant series is returned as it is:
    both as in TensorBoard.
    """
    finite = values[np.isfinite(values)]
    if len(finite) and np.all(finite == finite[0]):  # a constant: its average would only add rounding noise
        return values.astype(float)
    out = np.full(len(values), np.nan)
    last, k = 0.0, 0
    for i, x in enumerate(values):
        if not np.isfinite(x):
            continue
        last = weight * last + (1.0 - weight) * x
        k += 1
        out[i] = last / (1.0 - weight**k)
    return out


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, MAX_COLS)
    return math.ceil(n / cols), cols


def _new_figure(n_panels: int, sharey: bool = False) -> tuple[Figure, list]:
    rows, cols = _grid(n_panels)
    fig = Figure(figsize=(PANEL_W * cols, PANEL_H * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=sharey).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    for ax in axes[:n_panels]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    return fig, list(axes[:n_panels])


def plain(name: str) -> str:
    """`name` as matplotlib shows it literally: `$` starts no math, a leading `_` hides no legend entry."""
    return ("\u200b" if name.startswith("_") else "") + name.replace("$", r"\$")


def _draw(ax, series: Series, color: str, label: str, is_eval: bool, order: int = 0, smooth: bool = True) -> float | None:
    """One curve; the `order`-th run's is thinner, so equal curves of several runs all show.

    Returns the EMA weight when the curve was smoothed (a long train series), else None.
    """
    scale = max(0.45, 1.0 - 0.3 * order)
    if is_eval:  # markers a reader finds at a glance, joined by a dashed line
        ax.plot(series.steps, series.values, color=color, label=label, linestyle="--", marker="o",
                markersize=6 * scale, markeredgecolor="white", markeredgewidth=0.8, linewidth=1.4 * scale,
                zorder=4)
        return None
    if not smooth:
        ax.plot(series.steps, series.values, color=color, label=label, linewidth=1.9 * scale)
        return None
    if len(series.steps) < SMOOTH_MIN_POINTS:
        ax.plot(series.steps, series.values, color=color, label=label, marker="o", markersize=3.5 * scale,
                linewidth=1.9 * scale)
        return None
    weight = ema_weight(len(series.steps))
    ax.plot(series.steps, series.values, color=color, alpha=RAW_ALPHA, linewidth=0.8, label="_raw", zorder=1)
    ax.plot(series.steps, ema(series.values, weight), color=color, label=label, linewidth=1.9 * scale, zorder=2)
    return weight


def _line_panels(runs: Sequence[Run], names: list[str]) -> Figure:
    fig, axes = _new_figure(len(names))
    several = len(runs) > 1
    for ax, name in zip(axes, names):
        weights: set[float] = set()
        for i, run in enumerate(runs):
            for metric, is_eval in ((name, False), (EVAL + name, True)):
                if metric not in run.metrics:
                    continue
                color = f"C{i % 10}" if several else ("C1" if is_eval else "C0")
                split = "eval" if is_eval else "train"
                label = f"{run.label} ({split})" if several else split
                smooth = not any(fnmatch.fnmatchcase(name, p) for p in UNSMOOTHED)
                weight = _draw(ax, run.metrics[metric], color, plain(label), is_eval, order=i, smooth=smooth)
                if weight is not None:
                    weights.add(weight)
        ax.set_title(plain(name), fontsize=10)
        if weights:
            ax.set_title("EMA " + "/".join(f"{w:.2g}" for w in sorted(weights)), loc="right", fontsize=7,
                         color="#5b6570")
    _legend(fig, axes)
    return fig


def _stacked_panels(runs: Sequence[Run], names: list[str]) -> Figure:
    drawn = [run for run in runs if any(n in run.metrics for n in names)]
    fig, axes = _new_figure(len(drawn), sharey=True)
    for ax, run in zip(axes, drawn):
        steps = np.unique(np.concatenate([run.metrics[n].steps for n in names if n in run.metrics]))
        parts, labels, colors = [], [], []
        for j, name in enumerate(names):
            if name in run.metrics:
                s = run.metrics[name]
                column = np.zeros(len(steps))
                column[np.searchsorted(steps, s.steps)] = np.nan_to_num(s.values, nan=0.0)
                parts.append(column)
                labels.append(plain(name.removeprefix("timing/")))
                colors.append(f"C{j % 10}")
        if len(steps) >= 2:
            ax.stackplot(steps, parts, labels=labels, colors=colors, alpha=0.85)
        else:  # a stack over one step: stacked bars
            bottom = np.zeros(len(steps))
            for part, label, color in zip(parts, labels, colors):
                ax.bar(steps, part, bottom=bottom, label=label, color=color, width=0.6)
                bottom += part
        ax.set_title(plain(run.label) if len(runs) > 1 else "seconds per step, by stage", fontsize=10)
    _legend(fig, axes)
    return fig


def _legend(fig: Figure, axes: list) -> None:
    """One legend for the whole figure, below the panels (labels in first-drawn order)."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        columns = min(len(entries), 3 * _grid(len(axes))[1], 6)  # a narrow figure gets a taller legend
        fig.legend(list(entries.values()), list(entries), loc="outside lower center",
                   ncol=columns, fontsize=8, frameon=False)


def draw_group(runs: Sequence[Run], group: PlotGroup, names: list[str]) -> Figure:
    """The figure of `group` with panels for `names` (as chosen by `assign_groups`)."""
    fig = (_stacked_panels if group.stacked else _line_panels)(runs, names)
    fig.suptitle(group.title, fontsize=12, fontweight="bold")
    return fig


def write_plots(runs: Sequence[Run], out_dir: Path, prefix: str = "report-", stage: str = "") -> list[Plot]:
    """Draw every group the runs have into `out_dir/<prefix><group>.png`."""
    plots = []
    for group, names in assign_groups(runs):
        left_out = names[MAX_OTHER_PANELS:]
        names = names[:MAX_OTHER_PANELS]
        fig = draw_group(runs, group, names)
        path = out_dir / f"{prefix}{group.slug}.png"
        fig.savefig(path, dpi=100, facecolor="white")
        note = f"not plotted (see the summary table): {', '.join(left_out)}" if left_out else ""
        plots.append(Plot(group.title, path, names, note, stage))
    return plots
