"""`posttrain report`: plots and one HTML page that show what one or several runs did.

    from posttrain.report import write_report
    write_report(["runs/grpo"])                          # runs/grpo/report.html + report-*.png
    write_report(["runs/grpo", "runs/dapo"])             # runs/compare-grpo-dapo/report.html
    write_report(["runs/grpo", "runs/dapo"], "cmp")      # cmp/report.html

    write_report(["runs/sft", "runs/rl"], "out", evals=["out/eval_sft", "out/eval_rl"])
                                                         # a pipeline: before/after first

Output: one run → `RUN_DIR/report.html` and `RUN_DIR/report-<group>.png`; several runs →
the same files in `out_dir`, by default `compare-<name>-<name>...` next to the first run
(the names shortened when there are many). The PNGs are also inlined in the HTML, which
is self-contained (no external resources): it can be mailed or attached on its own.
Writing again replaces the report and removes `report-*.png` files it no longer makes.

Runs of the same kind share each plot; runs of different kinds (SFT and RL: see
`runs.stages`) get a section each, their PNGs named `report-<runs>-<group>.png`.
What is plotted is decided by the metrics the runs logged (see `plots.GROUPS`); the page
(see `html`) holds the summary table, the plots, the samples per eval step and each
run's config. Runs still in progress, or with missing files, give a report with notes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

from posttrain.report.html import render_page
from posttrain.report.pipeline import HEADLINE_PNG, draw_pipeline_accuracy, load_eval
from posttrain.report.plots import GROUPS, Plot, PlotGroup, write_plots
from posttrain.report.runs import Run, load_runs, run_labels, stages

__all__ = ["GROUPS", "PlotGroup", "Report", "Run", "default_out_dir", "load_runs", "write_report"]

REPORT_FILE = "report.html"
PNG_PREFIX = "report-"
MAX_DIR_NAME = 80


@dataclass
class Report:
    """The files a report was written to."""

    html: Path
    plots: list[Plot]
    runs: list[Run]
    headline: Plot | None = None  # the held-out accuracy across a pipeline's stages


def default_out_dir(run_dirs: Sequence[Path]) -> Path:
    """The run dir for one run; `compare-<names>` next to the first run for several."""
    if len(run_dirs) == 1:
        return run_dirs[0]
    names = [re.sub(r"[^A-Za-z0-9._-]+", "_", label) for label in run_labels(list(run_dirs))]
    name = "compare-" + "-".join(names)
    if len(name) > MAX_DIR_NAME:
        name = f"compare-{names[0][:40]}-and-{len(names) - 1}-more"
    return run_dirs[0].resolve().parent / name


def write_report(
    run_dirs: Sequence[str | PathLike], out_dir: str | PathLike | None = None,
    evals: Sequence[str | PathLike | None] | None = None,
) -> Report:
    """Write `report.html` and the plots for `run_dirs` (one run, or several overlaid).

    `evals`: one eval directory (eval.json, samples.jsonl) or None per run, when the runs
    are the stages of one pipeline in order (SFT, then RL on its model); the page then
    opens with the before/after table and the held-out accuracy across the pipeline.
    """
    if not run_dirs:
        raise ValueError("no run directory given")
    if evals is not None and len(evals) != len(run_dirs):
        raise ValueError(f"{len(evals)} eval directories for {len(run_dirs)} runs")
    paths = [Path(p) for p in run_dirs]
    runs = load_runs(paths)
    out = Path(out_dir) if out_dir is not None else default_out_dir(paths)
    out.mkdir(parents=True, exist_ok=True)
    split = stages(runs)
    plots = []
    for stage in split:
        name = ", ".join(r.label for r in stage) if len(split) > 1 else ""
        prefix = PNG_PREFIX + (re.sub(r"[^A-Za-z0-9._]+", "_", name) + "-" if name else "")
        plots += write_plots(stage, out, prefix=prefix, stage=name)
    loaded = [load_eval(Path(e)) if e is not None else None for e in evals] if evals is not None else None
    headline = None
    if loaded is not None and any(e is not None for e in loaded):
        fig = draw_pipeline_accuracy(runs, loaded)
        path = out / (PNG_PREFIX + HEADLINE_PNG)
        fig.savefig(path, dpi=100, facecolor="white")
        headline = Plot("Held-out accuracy across the pipeline", path, ["accuracy"])
    made = {p.path.name for p in plots} | ({headline.path.name} if headline else set())
    for stale in out.glob(f"{PNG_PREFIX}*.png"):
        if stale.name not in made:
            stale.unlink()
    html_path = out / REPORT_FILE
    tmp = html_path.with_name(REPORT_FILE + ".tmp")
    tmp.write_text(render_page(runs, plots, loaded, headline), encoding="utf-8")
    tmp.replace(html_path)
    return Report(html_path, plots, runs, headline)
