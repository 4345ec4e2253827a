"""The report's plots: one PNG per group of metrics, drawn only when the runs have them.

What is plotted is data: `GROUPS` lists (title, metric names) and a group is drawn when
any run logged any of its metrics, one panel per metric present. Names may be fnmatch
patterns (`logps/*`). A panel for `m` also shows `eval/m`: the train curve as a line,
the eval values (logged only at eval steps) dashed with markers. Several runs share each
panel, one colour per run. A `stacked` group (time per stage) is a stack per step, one
panel per run, since stacks of different runs cannot share axes.

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
)


@dataclass
class Plot:
    """A figure written to disk: what it shows and where the PNG is."""

    title: str
    path: Path
    metrics: list[str]  # base names (without `eval/`) of its panels, or the stacked metrics
    note: str = ""  # e.g. which metrics did not fit


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


def _draw(ax, series: Series, color: str, label: str, is_eval: bool, order: int = 0) -> None:
    """One curve; the `order`-th run's is thinner, so equal curves of several runs all show."""
    sparse = is_eval or len(series.steps) <= 40  # markers where single points matter
    scale = max(0.45, 1.0 - 0.3 * order)
    ax.plot(
        series.steps, series.values, color=color, label=label, linestyle="--" if is_eval else "-",
        marker="o" if sparse else None, markersize=(5 if is_eval else 3.5) * scale, linewidth=1.9 * scale,
    )


def _line_panels(runs: Sequence[Run], names: list[str]) -> Figure:
    fig, axes = _new_figure(len(names))
    several = len(runs) > 1
    for ax, name in zip(axes, names):
        for i, run in enumerate(runs):
            for metric, is_eval in ((name, False), (EVAL + name, True)):
                if metric not in run.metrics:
                    continue
                color = f"C{i % 10}" if several else ("C1" if is_eval else "C0")
                split = "eval" if is_eval else "train"
                label = f"{run.label} ({split})" if several else split
                _draw(ax, run.metrics[metric], color, plain(label), is_eval, order=i)
        ax.set_title(plain(name), fontsize=10)
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


def write_plots(runs: Sequence[Run], out_dir: Path, prefix: str = "report-") -> list[Plot]:
    """Draw every group the runs have into `out_dir/<prefix><group>.png`."""
    plots = []
    for group, names in assign_groups(runs):
        left_out = names[MAX_OTHER_PANELS:]
        names = names[:MAX_OTHER_PANELS]
        fig = draw_group(runs, group, names)
        path = out_dir / f"{prefix}{group.slug}.png"
        fig.savefig(path, dpi=100, facecolor="white")
        note = f"not plotted (see the summary table): {', '.join(left_out)}" if left_out else ""
        plots.append(Plot(group.title, path, names, note))
    return plots
