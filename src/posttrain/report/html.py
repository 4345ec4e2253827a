"""The report page: one self-contained HTML file (plots inlined as base64 PNG data URIs).

Sections: for the stages of a pipeline (see `pipeline`), first the before/after table and
the headline plot; notes (what was missing or skipped while reading), a summary table of
each metric's last value, the plots (with the smoothing stated; one heading per stage when
the runs are of several kinds), sample completions with their scores (for a pipeline
first the same held-out prompts before and after, then per eval step from samples.jsonl),
and each run's config.yaml (collapsible; with several runs, first a table of the keys
whose values differ). Every piece of run text goes through `text()` (HTML-escaped,
control characters shown as visible symbols), so a completion holding `<script>` is
shown, never run.

The page's only script records load and script errors and, once the page has loaded,
writes on `<body>`: `data-images-loaded="OK/TOTAL"` (the images that decoded),
`data-broken-images` (the alt texts of those that did not) and `data-errors`, each list
joined by `|`: a headless browser test reads them.
"""

from __future__ import annotations

import base64
import html
import json
import re
import time
from collections.abc import Sequence
from typing import Any

import yaml

from posttrain.report.pipeline import Eval, before_after, by_outcome, paired_samples
from posttrain.report.plots import EMA_MAX, EMA_MIN, EMA_SPAN, EVAL, SMOOTH_MIN_POINTS, Plot
from posttrain.report.runs import Run

MAX_SAMPLE_ROWS = 40  # per run and step
MAX_SAMPLE_STEPS = 40  # per run: an RL run logs training samples at every logged step
MAX_COMPARED_ROWS = 25  # per outcome in the before/after comparison
SMOOTHING_NOTE = (
    f"Smoothing: a train curve of {SMOOTH_MIN_POINTS} or more points is drawn as TensorBoard's debiased "
    f"exponential moving average, weight w = clip(1 - {EMA_SPAN}/N, {EMA_MIN}, {EMA_MAX}) for N points "
    "(named at each panel's top right), with the raw values faint behind it. Shorter curves, constants and "
    "schedules (learning rate, KL coefficient) are drawn as they are. Eval values are never smoothed: they "
    "are the markers on dashed lines."
)
MAX_TEXT_CHARS = 4000  # per cell
SUMMARY_ROWS_PER_TABLE, SUMMARY_MAX_TABLES = 22, 4  # the summary wraps into side-by-side tables
TEXT_COLUMNS = ("split", "prompt", "completion", "chosen", "rejected", "answer")
EPISODE_KEYS = ("spans", "episode")  # shown in the completion cell and the episode block, not as columns
SCORE_COLUMNS = ("score", "reward", "correct")

_CONTROL_PICTURES = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"} | {127: 0x2421}

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2228;
       margin: 0 auto; max-width: 1320px; padding: 16px 24px 48px; background: #fff; }
h1 { font-size: 22px; margin: 4px 0; } h2 { font-size: 18px; margin: 28px 0 8px;
     border-bottom: 1px solid #d8dde3; padding-bottom: 4px; } h3 { font-size: 15px; margin: 18px 0 6px; }
nav a { margin-right: 14px; } .meta { color: #5b6570; font-size: 12px; }
.notes { background: #fff8e1; border: 1px solid #f0d98c; padding: 6px 12px; border-radius: 4px; }
table { border-collapse: collapse; font-size: 12.5px; margin: 6px 0; }
th, td { border: 1px solid #d8dde3; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f5f7; position: sticky; top: 0; } td.num { text-align: right;
     font-variant-numeric: tabular-nums; white-space: nowrap; }
td.pos { background: #e3f4e1; } td.zero, td.neg { background: #fbe9e7; } .dim { color: #8a939c; font-size: 11px; }
.warn { color: #b3261e; font-size: 11px; }
.text { white-space: pre-wrap; word-break: break-word; font: 12px/1.35 ui-monospace, Menlo, Consolas, monospace;
        max-height: 14em; overflow: auto; max-width: 560px; }
.tables { display: flex; flex-wrap: wrap; gap: 0 18px; align-items: flex-start; }
.figures { display: flex; flex-wrap: wrap; gap: 8px 16px; align-items: flex-start; }
figure { margin: 6px 0 16px; max-width: 100%; } figure img { max-width: 100%; height: auto; border: 1px solid #eceff2; }
figcaption { color: #5b6570; font-size: 12px; }
details { margin: 4px 0; } summary { cursor: pointer; font-weight: 600; }
table.headline { font-size: 15px; margin: 8px 0 14px; } table.headline td, table.headline th { padding: 5px 14px; }
table.headline tr:nth-child(2) td { font-weight: 600; }
table.compare .text { max-width: 360px; }
pre.config { background: #f6f8fa; padding: 8px 12px; font-size: 12px; max-height: 40em; overflow: auto; }
.episode { border: 1px solid #d8dde3; border-radius: 4px; padding: 4px 12px 8px; margin: 6px 0 10px; }
.span.model { background: #e3f4e1; } .span.tool { background: #e3ecfb; } .span.environment { background: #fdf0d5; }
.span.untrained { text-decoration: line-through dotted #8a939c; color: #5b6570;
                  background-image: repeating-linear-gradient(135deg, transparent 0 5px, rgba(0,0,0,.06) 5px 7px); }
"""

SCRIPT = """
var reportErrors = [];
window.addEventListener("error", function (e) {
  var t = e.target;
  reportErrors.push(t && t !== window && t.tagName ? "failed to load a " + t.tagName.toLowerCase() : String(e.message));
}, true);
window.addEventListener("load", function () {
  var imgs = document.images, ok = 0, broken = [];
  for (var i = 0; i < imgs.length; i++) {
    if (imgs[i].complete && imgs[i].naturalWidth > 0) ok++; else broken.push(imgs[i].alt || String(i));
  }
  document.body.setAttribute("data-images-loaded", ok + "/" + imgs.length);
  document.body.setAttribute("data-broken-images", broken.join("|"));
  document.body.setAttribute("data-errors", reportErrors.join("|"));
});
"""


def text(value: Any) -> str:
    """`value` as HTML-safe text; control characters become visible symbols (U+2400...)."""
    return html.escape(str(value).translate(_CONTROL_PICTURES), quote=True)


def fmt(x: float) -> str:
    """A number for a table cell: 4 significant digits, integers as integers."""
    if x != x:
        return "NaN"
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.4g}"


def render_page(
    runs: Sequence[Run], plots: Sequence[Plot], evals: Sequence[Eval | None] | None = None,
    headline: Plot | None = None,
) -> str:
    """The whole report page for `runs` with `plots` (already written as PNG files).

    `evals` (one per run, or None): the runs are stages of one pipeline and these are
    their final models' held-out evaluations; the page then opens with the before/after
    table and `headline`, and its samples with the same prompts before and after.
    """
    labels = ", ".join(r.label for r in runs)
    pipeline = evals is not None and any(e is not None for e in evals)
    nav = [("summary", "Summary"), ("plots", "Plots"), ("samples", "Samples"), ("config", "Config")]
    if pipeline:
        nav.insert(0, ("before-after", "Before / after"))
    body = [
        f"<h1>posttrain report: {text(labels)}</h1>",
        _meta(runs),
        "<nav>" + "".join(f'<a href="#{i}">{t}</a>' for i, t in nav) + "</nav>",
        _lead(runs, evals, headline) if pipeline else "",
        _notes(runs, evals or ()),
        '<h2 id="summary">Summary: last value of each metric</h2>',
        _summary_table(runs, plots),
        '<h2 id="plots">Plots</h2>',
        f'<p class="dim">{text(SMOOTHING_NOTE)}</p>',
        _figures(plots),
        '<h2 id="samples">Samples</h2>',
        _comparison(runs, evals) if pipeline else "",
        *(_samples(run, open_last=(i == 0), heading=len(runs) > 1) for i, run in enumerate(runs)),
        '<h2 id="config">Config</h2>',
        _config_diff(runs) if len(runs) > 1 else "",
        *(_config(run) for run in runs),
    ]
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>posttrain report: {text(labels)}</title><style>{CSS}</style>"
        f"<script>{SCRIPT}</script></head>\n<body>\n" + "\n".join(b for b in body if b) + "\n</body></html>\n"
    )


def _meta(runs: Sequence[Run]) -> str:
    rows = "".join(
        f"<div>{text(r.label)}: <code>{text(r.path.resolve())}</code>, last step {text('-' if r.last_step is None else r.last_step)}</div>"
        for r in runs
    )
    return f'<div class="meta">{rows}<div>written {time.strftime("%Y-%m-%d %H:%M:%S")}</div></div>'


def _notes(runs: Sequence[Run], evals: Sequence[Eval | None]) -> str:
    items = [f"<li>{text(r.label)}: {text(n)}</li>" for r in runs for n in r.notes]
    items += [f"<li>{text(n)}</li>" for e in evals if e is not None for n in e.notes]
    return f'<div class="notes"><ul>{"".join(items)}</ul></div>' if items else ""


def _summary_rows(runs: Sequence[Run], plots: Sequence[Plot]) -> list[str]:
    """Metric names: those of the plots first (each with its eval twin), then the rest as logged."""
    names: dict[str, None] = {}
    for plot in plots:
        for base in plot.metrics:
            names.update({base: None, EVAL + base: None})
    for run in runs:
        names.update(dict.fromkeys(run.metrics))
    return [n for n in names if any(n in r.metrics for r in runs)]


def _summary_table(runs: Sequence[Run], plots: Sequence[Plot]) -> str:
    head = "".join(f"<th>{text(r.label)}</th>" for r in runs)
    last = "".join(f'<td class="num">{text(r.last_step)}</td>' for r in runs)
    names = _summary_rows(runs, plots)
    if not names:
        return "<p>No metrics logged yet.</p>"
    head = f"<tr><th>metric</th>{head}</tr>"
    rows = [f"<tr><td><i>last step</i></td>{last}</tr>"]
    for name in names:
        cells = "".join(_summary_cell(r, name) for r in runs)
        rows.append(f"<tr><td>{text(name)}</td>{cells}</tr>")
    per_table = max(SUMMARY_ROWS_PER_TABLE, -(-len(rows) // SUMMARY_MAX_TABLES))
    tables = [rows[i : i + per_table] for i in range(0, len(rows), per_table)]
    return '<div class="tables">' + "".join(f"<table>{head}{''.join(t)}</table>" for t in tables) + "</div>"


def _summary_cell(run: Run, name: str) -> str:
    series = run.metrics.get(name)
    if series is None:
        return '<td class="num dim">-</td>'
    last = series.last_finite()
    value = "null" if last is None else fmt(last[1])
    extra = ""
    if last is not None and last[0] != run.last_step:
        extra += f' <span class="dim">@{last[0]}</span>'
    if series.n_nonfinite:
        extra += f' <span class="warn" title="null, NaN or inf values">{series.n_nonfinite} non-finite</span>'
    return f'<td class="num">{value}{extra}</td>'


def _figures(plots: Sequence[Plot]) -> str:
    """The plots; with several stages, one heading per stage (its runs' steps are its own)."""
    if not plots:
        return "<p>No metrics to plot yet.</p>"
    by_stage: dict[str, list[Plot]] = {}
    for plot in plots:
        by_stage.setdefault(plot.stage, []).append(plot)
    parts = []
    for stage, group in by_stage.items():
        if len(by_stage) > 1:
            parts.append(f'<h3 id="stage-{text(_slug(stage))}">Stage: {text(stage)}</h3>')
        parts.append('<div class="figures">' + "".join(_figure(p) for p in group) + "</div>")
    return "".join(parts)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _lead(runs: Sequence[Run], evals: Sequence[Eval | None], headline: Plot | None) -> str:
    """The before/after table and the headline plot."""
    rows = before_after(evals)
    ev = next((e for e in reversed(evals) if e is not None), None)
    settings = ev.settings if ev else {}
    how = []
    if ev and ev.n_problems:
        how.append(f"{ev.n_problems} held-out problems")
    if settings.get("temperature") == 0.0:
        how.append("greedy")
    if "max_new_tokens" in settings:
        how.append(f"at most {settings['max_new_tokens']} new tokens")
    caption = "the final model of each stage, on the same problems" + (f" ({', '.join(how)})" if how else "")
    tint = {1: " pos", -1: " neg", 0: ""}
    cells = "".join(
        f"<tr><td>{text(r.label)}</td><td class=\"num\">{text(r.before)}</td><td class=\"num\">{text(r.after)}</td>"
        f'<td class="num{tint[r.better]}">{text(r.change)}</td></tr>'
        for r in rows
    )
    head = "".join(f"<th>{text(h)}</th>" for h in ("", f"after {runs[0].label}", f"after {runs[-1].label}", "change"))
    table = f'<table class="headline"><tr>{head}</tr>{cells}</table>' if rows else "<p>No held-out evaluation found.</p>"
    return (
        f'<h2 id="before-after">Before and after: {text(runs[0].label)} → {text(runs[-1].label)}</h2>'
        f'<p class="dim">{text(caption)}</p>{table}' + (_figure(headline) if headline else "")
    )


def _comparison(runs: Sequence[Run], evals: Sequence[Eval | None]) -> str:
    """The same held-out prompts answered by the first and the last stage's model."""
    before, after = evals[0], evals[-1]
    if before is None or after is None or len(evals) < 2:
        return ""
    a, b = runs[0].label, runs[-1].label
    pairs = paired_samples(before, after)
    parts = by_outcome(pairs)
    counts = ", ".join(f"{name}: {len(v)}" for name, v in parts.items())
    out = [f"<h3 id=\"before-after-samples\">Held-out prompts after {text(a)} and after {text(b)}</h3>",
           f'<p>{len(pairs)} prompts answered by both; {text(counts)}. '
           f'The first {MAX_COMPARED_ROWS} of each kind are shown.</p>']
    head = (f"<tr><th>prompt</th><th>answer</th><th>after {text(a)}</th><th>reward</th>"
            f"<th>after {text(b)}</th><th>reward</th></tr>")
    for i, (name, rows) in enumerate(parts.items()):
        if not rows:
            continue
        body = "".join(
            "<tr>" + _cell_text(x.get("prompt", "")) + _cell_text(x.get("answer", ""))
            + _cell_text(x.get("completion", "")) + _cell("reward", x.get("reward"))
            + _cell_text(y.get("completion", "")) + _cell("reward", y.get("reward")) + "</tr>"
            for x, y in rows[:MAX_COMPARED_ROWS]
        )
        is_open = " open" if i < 2 else ""
        out.append(f"<details{is_open}><summary>{text(name)}: {len(rows)}</summary>"
                   f'<table class="compare">{head}{body}</table></details>')
    return "".join(out)


def _figure(plot: Plot) -> str:
    data = base64.b64encode(plot.path.read_bytes()).decode("ascii")
    note = f"<figcaption>{text(plot.note)}</figcaption>" if plot.note else ""
    return (
        f'<figure id="plot-{text(plot.path.stem)}"><img alt="{text(plot.title)}" '
        f'src="data:image/png;base64,{data}">{note}</figure>'
    )


def _cell_text(value: Any) -> str:
    """Sample text; a conversation (list of {role, content}) as `role: content` lines."""
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        value = "\n".join(f"{m.get('role', '?')}: {m['content']}" for m in value)
    elif not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False)
    if len(value) > MAX_TEXT_CHARS:
        value = value[:MAX_TEXT_CHARS] + f"... ({len(value) - MAX_TEXT_CHARS} more characters)"
    return f'<td><div class="text">{text(value)}</div></td>'


def _cell(column: str, value: Any) -> str:
    if value is None and column not in TEXT_COLUMNS:
        return '<td class="num dim">null</td>'
    if isinstance(value, (int, float)):
        tint = ""
        if column in SCORE_COLUMNS:
            tint = " pos" if value > 0 else " zero"
        return f'<td class="num{tint}">{fmt(float(value))}</td>'
    return _cell_text("" if value is None else value)


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(dict.fromkeys(k for row in rows for k in row if k not in ("step", *EPISODE_KEYS)))
    numeric = [k for k in keys if all(isinstance(r.get(k), (int, float, type(None))) for r in rows)]
    known = [k for k in TEXT_COLUMNS if k in keys]
    rest = [k for k in keys if k not in known and k not in numeric]
    return known + [k for k in numeric if k not in known] + rest


def _samples(run: Run, open_last: bool, heading: bool) -> str:
    parts = [f"<h3>{text(run.label)}</h3>"] if heading else []
    if not run.samples:
        return "".join(parts) + f"<p>{text(_no_samples(run))}</p>"
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in run.samples:
        by_step.setdefault(row["step"], []).append(row)
    steps = sorted(by_step)
    shown = shown_steps(steps, MAX_SAMPLE_STEPS)
    if len(shown) < len(steps):
        parts.append(f'<p class="dim">Samples of {len(shown)} of the {len(steps)} steps that logged them, evenly '
                     f"spaced (the first and the last included); samples.jsonl holds them all.</p>")
    for step in reversed(shown):
        rows = by_step[step]
        columns = _columns(rows)
        head = "".join(f"<th>{text(c)}</th>" for c in columns)
        body = "".join(
            "<tr>" + "".join(_sample_cell(c, row) if c in row else "<td></td>" for c in columns) + "</tr>"
            for row in rows[:MAX_SAMPLE_ROWS]
        )
        more = f'<p class="dim">{len(rows) - MAX_SAMPLE_ROWS} more not shown</p>' if len(rows) > MAX_SAMPLE_ROWS else ""
        mean = _mean_scores(rows)
        is_open = " open" if open_last and step == steps[-1] else ""
        episode = next((r for r in rows if isinstance(r.get("episode"), dict)), None)
        parts.append(
            f"<details{is_open}><summary>step {step}: {len(rows)} samples{mean}</summary>"
            + (_episode(episode) if episode is not None else "")
            + f"<table><tr>{head}</tr>{body}</table>{more}</details>"
        )
    return "".join(parts)


def shown_steps(steps: list[int], k: int) -> list[int]:
    """At most k of the sorted `steps`, evenly spaced, the first and the last included."""
    if len(steps) <= k:
        return steps
    picks = sorted({round(i * (len(steps) - 1) / (k - 1)) for i in range(k)})
    return [steps[i] for i in picks]


def _no_samples(run: Run) -> str:
    """Why a run has no samples: no eval data (SFT, RM and DPO write samples at eval steps only)."""
    data = (run.config or {}).get("data")
    if isinstance(data, dict) and not data.get("eval_files"):
        return ("No samples: this run had no eval data (data.eval_files is empty), and SFT, reward-model "
                "and DPO runs write samples.jsonl at eval steps only. Set data.eval_files to see samples.")
    return "No samples logged (samples.jsonl is missing or empty)."


def _sample_cell(column: str, row: dict[str, Any]) -> str:
    """A sample's cell; a completion with `spans` shows who wrote each part and what was trained."""
    if column == "completion" and isinstance(row.get("spans"), list):
        return f'<td><div class="text">{_spans(row["spans"])}</div></td>'
    return _cell(column, row[column])


def _spans(spans: list[dict[str, Any]]) -> str:
    """The spans of a completion, coloured by author; those not trained on (response_mask 0)
    hatched and struck through, each with a tooltip saying so."""
    out, shown = [], 0
    for span in spans:
        part = str(span.get("text", ""))[: max(0, MAX_TEXT_CHARS - shown)]
        shown += len(part)
        author = str(span.get("author", "model"))
        trained = "trained" if span.get("trained") else "untrained"
        tip = f"{author}, tokens {span.get('tokens')}, " + ("trained" if span.get("trained") else "not trained (mask 0)")
        out.append(f'<span class="span {text(author)} {trained}" title="{text(tip)}">{text(part)}</span>')
    return "".join(out)


def _episode(row: dict[str, Any]) -> str:
    """One episode in full: the prompt as the model saw it after reset, the trajectory by
    author with the untrained spans marked, and its turns (text, tool calls with results, reward)."""
    ep = row["episode"]
    legend = ('<p class="dim">Legend: <span class="span model trained">model, trained</span> '
              '<span class="span model untrained">model, not trained</span> '
              '<span class="span tool untrained">tool result</span> '
              '<span class="span environment untrained">environment</span></p>')
    reset = f' <span class="dim">(reset() added {text(json.dumps(ep.get("reset")))})</span>' if ep.get("reset") else ""
    head = "".join(f"<th>{h}</th>" for h in ("turn", "model text", "tool calls → results", "step reward"))
    turns = "".join(
        f"<tr><td class=\"num\">{k + 1}</td>{_cell_text(t.get('text', ''))}"
        f"{_cell_text(_calls_text(t))}{_cell('reward', t.get('reward'))}</tr>"
        for k, t in enumerate(ep.get("turns", []))
    )
    env_reward = ep.get("env_reward")
    return (
        f'<div class="episode"><h4>Episode: the first training row, environment reward '
        f'{text("none" if env_reward is None else fmt(float(env_reward)))}, score {text(fmt(float(row.get("score", 0.0))))}</h4>'
        f"{legend}<p>Prompt{reset}:</p><div class=\"text\">{text(ep.get('prompt', ''))}</div>"
        f'<p>Trajectory:</p><div class="text">{_spans(row.get("spans", []))}</div>'
        f"<table><tr>{head}</tr>{turns}</table></div>"
    )


def _calls_text(turn: dict[str, Any]) -> str:
    lines = [f"{c.get('name')}({c.get('arguments')}) → {c.get('result')}" + (" [error]" if c.get("error") else "")
             for c in turn.get("calls", [])]
    if turn.get("error"):
        lines.append(f"environment error: {turn['error']}")
    return "\n".join(lines)


def _mean_scores(rows: list[dict[str, Any]]) -> str:
    """The heading's suffix for a step's samples, e.g. `, mean score: eval 0.25, train 0.5`."""
    column = next((c for c in SCORE_COLUMNS if any(isinstance(r.get(c), (int, float)) for r in rows)), None)
    if column is None:
        return ""
    by_split: dict[str, list[float]] = {}
    for row in rows:
        if isinstance(row.get(column), (int, float)):
            by_split.setdefault(str(row.get("split", "")), []).append(float(row[column]))
    means = [f"{split} {fmt(sum(v) / len(v))}".strip() for split, v in by_split.items()]
    return f", mean {text(column)}: {text(', '.join(means))}"


def _config(run: Run) -> str:
    if run.config_text is None:
        return f"<p>{text(run.label)}: no config.yaml.</p>"
    return (
        f"<details><summary>config.yaml: {text(run.label)}</summary>"
        f'<pre class="config">{text(run.config_text)}</pre></details>'
    )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def _config_diff(runs: Sequence[Run]) -> str:
    """A table of the config keys whose values differ between the runs."""
    flats = []
    for run in runs:
        try:
            flats.append(_flatten(yaml.safe_load(run.config_text or "") or {}))
        except yaml.YAMLError:
            flats.append({})
    keys = list(dict.fromkeys(k for flat in flats for k in flat))
    missing = object()
    differ = [k for k in keys if len({json.dumps(f.get(k, missing), default=str) for f in flats}) > 1]
    if not differ:
        return "<p>The configs do not differ.</p>"
    head = "".join(f"<th>{text(r.label)}</th>" for r in runs)
    rows = "".join(
        f"<tr><td>{text(k)}</td>"
        + "".join(f"<td>{text(json.dumps(f[k], default=str)) if k in f else '-'}</td>" for f in flats)
        + "</tr>"
        for k in differ
    )
    return f"<h3>Differences</h3><table><tr><th>key</th>{head}</tr>{rows}</table>"
