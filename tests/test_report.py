"""`posttrain report`: reading run directories, choosing plots, the HTML page, and the page
rendered by headless Chromium (installed with apt-get when absent and we are root).

The RL runs are hand-written metrics.jsonl/samples.jsonl/config.yaml files in our own
formats (with the metric names `posttrain grpo` logs); the SFT run is a real `SFTTrainer`
run of 3 steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from posttrain.cli import main
from posttrain.report import default_out_dir, write_report
from posttrain.report.html import render_page
from posttrain.report.plots import GROUPS, assign_groups, draw_group, ema, ema_weight
from posttrain.report.runs import load_run, read_jsonl, run_labels, stages

STAGES = {"timing/gen": 0.5, "timing/reward": 0.02, "timing/old_logprob": 0.1, "timing/ref": 0.1, "timing/adv": 0.001,
          "timing/update_actor": 0.8}


def _rl_metrics(step: int, seed: int) -> dict:
    """One step of `posttrain grpo` metrics, drifting with the step like a run that learns."""
    rng = np.random.default_rng(seed * 1000 + step)
    acc = min(1.0, 0.1 * step + 0.05 * seed)
    row = {
        "step": step, "policy_loss": float(rng.normal(0, 0.05)), "clip_frac": 0.02 * step,
        "clip_frac/low": 0.01 * step, "clip_frac/high": 0.01 * step, "approx_kl": 0.001 * step,
        "ratio/mean": 1.0, "entropy": 2.0 - 0.1 * step, "grad_norm": float(rng.uniform(0.5, 2)),
        "kl": 0.002 * step, "advantage/mean": 0.0, "reward/task_reward/mean": acc, "reward/mean": acc,
        "reward/std": 0.3, "accuracy": acc, "response_length/mean": 30.0 - step, "response_length/max": 48,
        "truncation_rate": max(0.0, 0.5 - 0.05 * step), "lr": 1e-5, "nonfinite_steps": 0,
        **{k: v * (1 + 0.1 * seed) for k, v in STAGES.items()}, "timing/step": 1.6,
    }
    if step == 1:
        row["data/n_rows"] = 300
    return row


def write_rl_run(run: Path, seed: int = 0, steps: int = 8, torn: bool = True) -> Path:
    """A GRPO run dir: eval every 4 steps, a null KL at step 2 and, if `torn`, a half-written last line."""
    run.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        row = _rl_metrics(step, seed)
        if step == 2:
            row["kl"] = None  # NaN/inf are logged as null
        if step % 4 == 0:
            row |= {"eval/accuracy": 0.1 * step, "eval/response_length/mean": 25.0, "timing/eval": 0.7}
        lines.append(json.dumps(row))
    text = "\n".join(lines) + "\n"
    if torn:
        text += json.dumps(_rl_metrics(steps + 1, seed))[:40]
    (run / "metrics.jsonl").write_text(text)
    samples = [
        {"step": s, "split": split, "prompt": f"{i}+{s}=", "completion": f"{i + s}</answer>", "answer": str(i + s),
         "score": float(i % 2)}
        for s in (4, 8) for split in ("eval", "train") for i in range(3)
    ]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    (run / "config.yaml").write_text(
        f"model:\n  path: runs/sft/final\nrollout:\n  n: {4 + 4 * seed}\n  temperature: 1.0\n"
        f"algorithm:\n  adv_estimator: grpo\ntrainer:\n  output_dir: {run}\n  max_steps: {steps}\n"
    )
    return run


@pytest.fixture
def rl_run(tmp_path):
    return write_rl_run(tmp_path / "grpo")


# ------------------------------------------------------------------------------- reading


def test_read_jsonl_skips_a_torn_last_line_and_bad_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"loss": 1.0}\n{"step": 2, "loss": NaN}\n{"step": 3, "lo')
    rows, notes = read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2]
    assert any("partial last line" in n for n in notes)
    assert any("skipped 2 unreadable" in n and "2, 3" in n for n in notes)


def test_metric_series_nulls_repeats_and_sparse_eval(rl_run):
    with (rl_run / "metrics.jsonl").open("a") as f:  # the torn line was cut off, then step 8 again
        f.write('\n{"step": 8, "accuracy": 0.99, "note": "text is no metric"}\n')
    run = load_run(rl_run, "grpo")
    assert run.last_step == 8  # the torn step-9 line is skipped (and the garbage line it became)
    kl = run.metrics["kl"]
    assert kl.steps.tolist() == list(range(1, 9)) and math.isnan(kl.values[1]) and kl.n_nonfinite == 1
    assert run.metrics["eval/accuracy"].steps.tolist() == [4, 8]
    assert run.metrics["accuracy"].last_finite() == (8, 0.99)  # a repeated step: the later value wins
    assert "note" not in run.metrics and run.metrics["data/n_rows"].steps.tolist() == [1]
    assert run.metrics["response_length/mean"].values[0] == 29.0  # first value survives the repeat


def test_missing_files_are_notes_and_a_non_run_is_an_error(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text("trainer:\n  max_steps: 3\n")
    run = load_run(tmp_path / "r", "r")
    assert run.metrics == {} and run.last_step is None
    assert any("no metrics.jsonl" in n for n in run.notes) and any("no samples.jsonl" in n for n in run.notes)
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        load_run(tmp_path, "x")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_run(tmp_path / "nope", "x")


def test_a_run_without_eval_data_says_why_it_has_no_samples(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / "config.yaml").write_text("data:\n  train_files: [t.jsonl]\n  eval_files: []\ntrainer:\n  max_steps: 1\n")
    page = render_page([load_run(run, "sft")], [])
    assert "No samples: this run had no eval data (data.eval_files is empty)" in page
    assert "No samples logged" not in page


def test_samples_of_many_steps_are_thinned_evenly():
    from posttrain.report.html import shown_steps

    assert shown_steps([1, 2, 3], 5) == [1, 2, 3]
    assert shown_steps(list(range(1, 101)), 4) == [1, 34, 67, 100]


def test_a_run_without_a_critic_shows_no_critic_metrics(tmp_path):
    """Runs logged before GRPO left them out hold the critic's metrics as zeros: not shown."""
    for name, estimator in (("grpo", "grpo"), ("ppo", "gae")):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "policy_loss": 0.1, "value_loss": 0.0,
                                                       "critic/grad_norm": 0.0, "timing/values": 0.0}) + "\n")
        (run / "config.yaml").write_text(f"algorithm:\n  adv_estimator: {estimator}\n")
    assert list(load_run(tmp_path / "grpo", "grpo").metrics) == ["policy_loss"]
    assert len(load_run(tmp_path / "ppo", "ppo").metrics) == 4


def test_labels_and_default_output_dirs(tmp_path):
    a, b = tmp_path / "x" / "run", tmp_path / "y" / "run"
    assert run_labels([a, b]) == ["x/run", "y/run"]
    assert run_labels([tmp_path / "grpo", tmp_path / "dapo"]) == ["grpo", "dapo"]
    assert default_out_dir([a]) == a
    assert default_out_dir([tmp_path / "grpo", tmp_path / "dapo"]) == tmp_path.resolve() / "compare-grpo-dapo"
    assert default_out_dir([a, b]) == (tmp_path / "x").resolve() / "compare-x_run-y_run"


# ------------------------------------------------------------------------------- plots


def _groups(runs) -> dict[str, list[str]]:
    return {group.title: names for group, names in assign_groups(runs)}


def test_groups_follow_the_metrics_present(rl_run, tmp_path):
    rl = _groups([load_run(rl_run, "grpo")])
    assert rl["Reward and accuracy"] == ["reward/mean", "reward/std", "accuracy"]
    assert rl["KL and entropy"] == ["kl", "approx_kl", "entropy"]
    assert rl["Clipping"] == ["clip_frac", "clip_frac/low", "clip_frac/high", "ratio/mean"]
    assert rl["Response length and truncation"] == ["response_length/mean", "response_length/max", "truncation_rate"]
    assert rl["Time per stage (s)"] == [s for s in GROUPS[10].metrics if s in STAGES]
    assert rl["Reward per function"] == ["reward/task_reward/mean"]
    assert "Preference rewards" not in rl and "Other metrics" not in rl  # constants and one-offs are not plotted

    dpo = tmp_path / "dpo"
    dpo.mkdir()
    rows = [{"step": s, "loss": 0.7 - 0.05 * s, "rewards/chosen": 0.1 * s, "rewards/rejected": -0.1 * s,
             "rewards/accuracies": 0.5 + 0.05 * s, "rewards/margins": 0.2 * s, "logps/chosen": -80.0 + s,
             "logps/rejected": -85.0 - s, "my_new/metric": float(s % 3)} for s in (1, 2, 3)]
    (dpo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = _groups([load_run(dpo, "dpo")])
    assert list(groups) == ["Loss", "Preference rewards", "Log-probabilities", "Other metrics"]
    assert groups["Log-probabilities"] == ["logps/chosen", "logps/rejected"]
    assert groups["Other metrics"] == ["my_new/metric"]  # a new trainer's metric still shows up


def test_two_runs_overlaid_one_line_per_run_and_split(rl_run, tmp_path):
    runs = [load_run(rl_run, "grpo"), load_run(write_rl_run(tmp_path / "dapo", seed=1, torn=False), "dapo")]
    groups = dict((g.title, (g, names)) for g, names in assign_groups(runs))
    fig = draw_group(runs, *groups["Reward and accuracy"])
    accuracy = next(ax for ax in fig.axes if ax.get_title() == "accuracy")
    lines = {line.get_label(): line for line in accuracy.get_lines()}
    assert list(lines) == ["grpo (train)", "grpo (eval)", "dapo (train)", "dapo (eval)"]
    assert lines["grpo (eval)"].get_xdata().tolist() == [4, 8] and lines["grpo (eval)"].get_marker() == "o"
    assert lines["grpo (train)"].get_color() != lines["dapo (train)"].get_color()
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == sorted(lines)  # one shared legend
    stacks = draw_group(runs, *groups["Time per stage (s)"])
    assert [ax.get_title() for ax in stacks.axes] == ["grpo", "dapo"]  # one stack per run
    top = stacks.axes[0].collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(sum(STAGES.values()))  # the stages stack up to their sum


def test_ema_is_tensorboards_debiased_average():
    """Worked by hand, w = 0.5: last = 0.5, 1.75; debiased by 1 - 0.5 and 1 - 0.25: 1.0, 2.3333.
    A NaN is a gap that does not move the average; a constant stays exactly itself."""
    assert ema(np.array([1.0, 3.0]), 0.5) == pytest.approx([1.0, 1.75 / 0.75])
    smoothed = ema(np.array([1.0, np.nan, 3.0]), 0.5)
    assert math.isnan(smoothed[1]) and smoothed[[0, 2]] == pytest.approx([1.0, 1.75 / 0.75])
    assert ema(np.array([0.2] * 30), 0.9).tolist() == [0.2] * 30
    assert [ema_weight(n) for n in (20, 75, 150, 300, 1000)] == pytest.approx([0.6, 0.6, 0.8, 0.9, 0.9])


def test_long_curves_are_smoothed_short_ones_and_schedules_are_not(tmp_path):
    run_dir = tmp_path / "long"
    run_dir.mkdir()
    rng = np.random.default_rng(0)
    rows = [{"step": s, "loss": 2.0 / s + float(rng.normal(0, 0.1)), "lr": 1e-3 * s / 100} for s in range(1, 101)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(run_dir, "long")
    loss_fig = draw_group([run], GROUPS[1], ["loss"])
    raw, smooth = loss_fig.axes[0].get_lines()
    assert raw.get_label() == "_raw" and raw.get_alpha() < 0.5 and smooth.get_label() == "train"
    assert np.allclose(smooth.get_ydata(), ema(run.metrics["loss"].values, 0.7))  # 1 - 30/100
    assert loss_fig.axes[0].get_title(loc="right") == "EMA 0.7"
    lr_fig = draw_group([run], GROUPS[9], ["lr"])
    assert [line.get_label() for line in lr_fig.axes[0].get_lines()] == ["train"]  # the schedule as it is
    assert lr_fig.axes[0].get_title(loc="right") == ""


def test_runs_of_different_kinds_are_separate_stages(rl_run, tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    (sft / "config.yaml").write_text("model:\n  init: tiny\ntrainer:\n  max_steps: 2\neval:\n  task: arithmetic\n")
    dapo = write_rl_run(tmp_path / "dapo", seed=1, torn=False)
    runs = [load_run(p, p.name) for p in (sft, rl_run, dapo)]
    assert [[r.label for r in stage] for stage in stages(runs)] == [["sft"], ["grpo", "dapo"]]
    report = write_report([sft, rl_run, dapo], tmp_path / "out")
    assert {p.stage for p in report.plots} == {"sft", "grpo, dapo"}
    loss = [p for p in report.plots if p.title == "Loss"]
    assert [(p.stage, p.metrics, p.path.name) for p in loss] == [
        ("sft", ["loss"], "report-sft-loss.png"), ("grpo, dapo", ["policy_loss"], "report-grpo_dapo-loss.png")]
    page = report.html.read_text()
    assert "Stage: sft</h3>" in page and "Stage: grpo, dapo</h3>" in page
    assert "before-after" not in page  # no eval directories given: no pipeline table


def test_names_are_drawn_literally(tmp_path):
    """`$` in a metric name starts no mathtext (which would fail to parse), `_run` keeps its legend entry."""
    run_dir = tmp_path / "_run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "cost$": 1}\n{"step": 2, "cost$": 2}\n')
    plots = write_report([run_dir]).plots
    assert [p.metrics for p in plots] == [["cost$"]] and plots[0].path.stat().st_size > 1000
    assert main(["report", str(run_dir), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "report.html").is_file() and (tmp_path / "elsewhere" / plots[0].path.name).is_file()
    fig = draw_group([load_run(run_dir, "_run"), load_run(run_dir, "$x$")], *assign_groups([load_run(run_dir, "r")])[0])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["\u200b_run (train)", r"\$x\$ (train)"]


# ------------------------------------------------------------------------------- page


def test_html_escapes_sample_text_and_summarises(rl_run):
    with (rl_run / "samples.jsonl").open("a") as f:
        f.write(json.dumps({"step": 8, "prompt": "p & q", "completion": "<script>alert(1)</script>\x17",
                            "score": None}) + "\n")
    run = load_run(rl_run, "grpo")
    page = render_page([run], [])
    assert page.count("<script") == 1  # the page's own image counter only
    assert "&lt;script&gt;alert(1)&lt;/script&gt;\u2417" in page and "p &amp; q" in page
    assert "step 8: 7 samples, mean score: eval 0.3333, train 0.3333" in page
    assert "partial last line" in page  # the notes
    assert re.search(r"<td>kl</td><td class=\"num\">0.016 <span class=\"warn\"[^>]*>1 non-finite", page)
    assert "rollout:\n  n: 4" in page  # the config


def test_report_of_two_runs_and_the_cli(rl_run, tmp_path, capsys):
    other = write_rl_run(tmp_path / "dapo", seed=1, torn=False)
    out = tmp_path / "compare-grpo-dapo"
    out.mkdir()
    (out / "report-stale.png").write_bytes(b"from an earlier report")
    assert main(["report", str(rl_run), str(other)]) == 0
    assert f"wrote {out / 'report.html'}" in capsys.readouterr().out
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(list(out.glob("report-*.png"))) >= 10
    assert "<h3>Differences</h3>" in page and "rollout.n" in page and "trainer.output_dir" in page
    assert page.count("config.yaml: ") == 2 and "<h3>dapo</h3>" in page
    assert not re.search(r"(src|href)=\"(?!data:|#)", page)  # self-contained
    assert not (out / "report-stale.png").exists()
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "run directory not found" in capsys.readouterr().err


# ------------------------------------------------------------------------------- browser

CHROMIUM = "/usr/bin/chromium"


def chromium_or_skip() -> str:
    """The chromium binary; installed with apt-get (quietly, once) when absent and we are root."""
    found = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if found:
        return found
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("chromium is not installed (apt-get install chromium; the test installs it only as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=120", "chromium"]
    for cmd in (install, ["apt-get", "update", "-qq"], install):  # the package lists may be stale or absent
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode == 0 and os.path.exists(CHROMIUM):
            return CHROMIUM
    pytest.skip(f"could not install chromium with apt-get: {(done.stderr or done.stdout).strip()[-300:]}")


def _chromium(binary: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


def _pixels(png: Path) -> np.ndarray:
    """(H, W, 3) uint8 RGB."""
    try:
        from PIL import Image

        return np.asarray(Image.open(png).convert("RGB"))
    except ImportError:
        import matplotlib.image

        return (matplotlib.image.imread(png)[..., :3] * 255).round().astype(np.uint8)


def test_report_of_a_real_sft_run_renders_in_chromium(tmp_path):
    """A 3-step SFTTrainer run: its page loads every image and shows the plots in Chromium."""
    binary = chromium_or_skip()
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.config import build_config
    from posttrain.data.tasks import make_task

    data = make_task("arithmetic", tmp_path / "data", n_train=64, n_test=4, seed=0, difficulty="easy")
    run = tmp_path / "sft"
    overrides = {
        "model.init": "tiny", "data.train_files": f"[{data['train']}]", "data.eval_files": f"[{data['test']}]",
        "data.train_batch_size": 8, "trainer.max_steps": 3, "trainer.eval_steps": 2, "eval.task": "arithmetic",
        "eval.num_examples": 4, "eval.max_new_tokens": 8, "trainer.output_dir": run, "trainer.report_to": "[]",
        "trainer.progress": False,
    }
    SFTTrainer(args=build_config(SFTConfig, None, [f"{k}={v}" for k, v in overrides.items()])).train()
    report = write_report([run])
    assert report.html == run / "report.html"
    titles = [p.title for p in report.plots]
    assert titles[:2] == ["Reward and accuracy", "Loss"] and "Time per stage (s)" not in titles
    assert report.plots[1].metrics == ["loss", "perplexity"]  # eval/loss and eval/perplexity on their panels

    dom = _chromium(binary, tmp_path, "--virtual-time-budget=10000", "--dump-dom", report.html.as_uri())
    loaded = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom.stdout)
    assert loaded, f"the page's load script did not run: {dom.stderr[-500:]}"
    assert loaded.group(1) == loaded.group(2) == str(len(report.plots))

    shot = tmp_path / "screenshot.png"
    _chromium(binary, tmp_path, f"--screenshot={shot}", "--window-size=1200,3000", report.html.as_uri())
    pixels = _pixels(shot)
    assert pixels.shape[:2] == (3000, 1200) and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    blue = np.all(np.abs(pixels.astype(int) - (31, 119, 180)) < 30, axis=-1)  # matplotlib's C0: the train curves
    assert blue.sum() > 500


def test_an_async_run_s_staleness_and_overlap_get_a_figure(tmp_path):
    run_dir = tmp_path / "async"
    run_dir.mkdir()
    rows = [{"step": s, "reward/mean": 0.1 * s, "async/staleness/mean": min(s - 1, 1) * 0.9,
             "async/staleness/max": float(min(s - 1, 1)), "perf/overlap": 0.2 * min(s, 3), "timing/wait_update": 0.1}
            for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = _groups([load_run(run_dir, "async")])
    assert groups["Asynchronous RL: staleness and overlap"] == ["async/staleness/mean", "async/staleness/max",
                                                                "perf/overlap", "timing/wait_update"]
