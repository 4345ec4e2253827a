"""The demo's report page as a person sees it: a demo-sized pipeline (1000 SFT steps, 560
RL steps, both evaluations) rendered by headless Chromium, driven over the DevTools
protocol on a pipe (`--remote-debugging-pipe`: no websocket client needed).

The runs are hand-written files in our own formats (the metric names `posttrain sft` and
`posttrain grpo` log, the eval directories `posttrain eval` writes), so the page has the
shape of a full demo's without training anything. The browser test skips where Debian's
`chromium` is not installed (`.ci/run` installs it).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from posttrain.report import write_report
from posttrain.report.plots import EVAL

SFT_STEPS, SFT_EVAL_EVERY, RL_STEPS, RL_EVAL_EVERY, N_PROBLEMS = 1000, 250, 560, 25, 60
SFT_CONFIG = "model:\n  init: tiny\ndata:\n  train_batch_size: 16\ntrainer:\n  max_steps: 1000\neval:\n  num_examples: 100\n"
RL_CONFIG = ("model:\n  path: sft/final\ndata:\n  train_batch_size: 8\nrollout:\n  n: 8\nactor:\n  micro_batch_size: 16\n"
             "critic:\n  enabled: false\nreward:\n  functions: [task_reward]\nalgorithm:\n  adv_estimator: grpo\n"
             "trainer:\n  max_steps: 560\neval:\n  num_examples: 100\n")
HOSTILE = '<img src="x" onerror="alert(1)"><script>alert(2)</script>'  # must show as text, never run


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _eval_dir(path: Path, rng: np.random.Generator, p_correct: float) -> list[bool]:
    """eval.json and samples.jsonl of N_PROBLEMS greedy completions, a fraction `p_correct` right."""
    path.mkdir(parents=True)
    right = [bool(x) for x in rng.random(N_PROBLEMS) < p_correct]
    rows = []
    for i, ok in enumerate(right):
        a, b = i % 10, (3 * i) % 10
        completion = f"Answer: {a + b if ok else a + b + 1}"
        if i == 1:
            completion += "\n" + HOSTILE + "\n" + "a long line that has to wrap " * 12
        rows.append({"prompt_index": i, "sample_index": 0, "prompt": f"{a}+{b}+{i}=", "completion": completion,
                     "answer": str(a + b), "reward": float(ok), "rewards": {"task_reward": float(ok)},
                     "correct": bool(ok), "finish_reason": "stop", "length": len(completion)})
    _jsonl(path / "samples.jsonl", rows)
    acc = sum(right) / N_PROBLEMS
    metrics = {"accuracy": acc, "pass@1": acc, "response_length/mean": 10.5 - 2 * acc, "truncation_rate": 0.0,
               "reward/mean": acc, "num_prompts": float(N_PROBLEMS), "num_samples": float(N_PROBLEMS)}
    settings = {"n": 1, "temperature": 0.0, "max_new_tokens": 32, "num_prompts": N_PROBLEMS}
    (path / "eval.json").write_text(json.dumps({"metrics": metrics, "settings": settings}))
    return right


def write_demo_dir(out: Path) -> Path:
    """A finished full demo's run and eval directories, under `out`."""
    rng = np.random.default_rng(0)
    sft, rl = out / "sft", out / "rl"
    sft.mkdir(parents=True)
    rl.mkdir()
    rows = []
    for s in range(1, SFT_STEPS + 1):
        row = {"step": s, "loss": 0.3 + 2.5 * float(np.exp(-s / 150)) + float(rng.normal(0, 0.12)),
               "grad_norm": float(rng.uniform(0.5, 2)), "lr": 3e-3 * min(1, s / 50), "timing/step": 0.2}
        if s % SFT_EVAL_EVERY == 0:
            row |= {"eval/loss": 0.35 + 2.0 * float(np.exp(-s / 150)), "eval/accuracy": 0.12 * s / SFT_EVAL_EVERY}
        rows.append(row)
    _jsonl(sft / "metrics.jsonl", rows)
    _jsonl(sft / "samples.jsonl", [{"step": s, "prompt": "1+2=", "completion": "Answer: 3", "answer": "3", "score": 1.0}
                                   for s in range(SFT_EVAL_EVERY, SFT_STEPS + 1, SFT_EVAL_EVERY)])
    (sft / "config.yaml").write_text(SFT_CONFIG)
    rows = []
    for s in range(1, RL_STEPS + 1):
        acc = float(np.clip(0.48 + 0.2 * s / RL_STEPS + rng.normal(0, 0.12), 0, 1))
        row = {"step": s, "reward/mean": acc, "accuracy": acc, "kl": 0.02 * s / RL_STEPS, "entropy": 1.0 - 0.3 * s / RL_STEPS,
               "response_length/mean": 11 + float(rng.normal(0, 0.5)), "clip_frac": float(rng.uniform(0, 0.05)),
               "policy_loss": float(rng.normal(0, 0.02)), "lr": 5e-5}
        if s % RL_EVAL_EVERY == 0:
            row |= {"eval/accuracy": 0.48 + 0.2 * s / RL_STEPS + float(rng.normal(0, 0.02))}
        rows.append(row)
    _jsonl(rl / "metrics.jsonl", rows)
    (rl / "config.yaml").write_text(RL_CONFIG)
    before = _eval_dir(out / "eval_sft", rng, 0.48)
    after = _eval_dir(out / "eval_rl", rng, 0.68)
    (out / "expected.json").write_text(json.dumps({"before": sum(before), "after": sum(after),
                                                   "fixed": sum(not a and b for a, b in zip(before, after))}))
    return out


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory):
    out = write_demo_dir(tmp_path_factory.mktemp("demo"))
    report = write_report([out / "sft", out / "rl"], out, evals=[out / "eval_sft", out / "eval_rl"])
    return out, report


# ------------------------------------------------------------------------------- the page


def test_the_page_opens_with_the_before_after_table_and_the_headline(demo_report):
    out, report = demo_report
    page = report.html.read_text()
    expected = json.loads((out / "expected.json").read_text())
    table, headline = page.index('<table class="headline">'), page.index('id="plot-report-pipeline-accuracy"')
    assert table < headline < page.index('id="summary"') < page.index('id="plots"')
    acc = {k: 100 * v / N_PROBLEMS for k, v in expected.items()}
    row = re.search(r"<td>held-out accuracy</td>(.*?)</tr>", page).group(1)
    assert re.findall(r">([^<]+)</td>", row) == [f"{acc['before']:.1f}%", f"{acc['after']:.1f}%",
                                                 f"{acc['after'] - acc['before']:+.1f} pts"]
    assert f"{N_PROBLEMS} held-out problems, greedy" in page
    assert report.headline is not None and report.headline.path.is_file()


def test_each_stage_has_its_own_plots(demo_report):
    _, report = demo_report
    stages = {p.stage for p in report.plots}
    assert stages == {"sft", "rl"}
    sft = {p.title: p.metrics for p in report.plots if p.stage == "sft"}
    rl = {p.title: p.metrics for p in report.plots if p.stage == "rl"}
    assert sft["Loss"] == ["loss"] and sft["Reward and accuracy"] == ["accuracy"]  # eval accuracy only
    assert rl["Reward and accuracy"] == ["reward/mean", "accuracy"] and rl["Clipping"] == ["clip_frac"]
    assert rl["KL and entropy"] == ["kl", "entropy"] and rl["Response length and truncation"] == ["response_length/mean"]
    assert all(p.path.name.startswith(f"report-{p.stage}-") for p in report.plots)
    page = report.html.read_text()
    assert page.index("<h3 id=\"stage-sft\">Stage: sft</h3>") < page.index("<h3 id=\"stage-rl\">Stage: rl</h3>")
    assert "TensorBoard&#x27;s debiased exponential moving average" in page  # the smoothing is stated


def test_headline_plot_puts_the_stages_one_after_the_other(demo_report):
    out, report = demo_report
    from posttrain.report.pipeline import draw_pipeline_accuracy, load_eval

    fig = draw_pipeline_accuracy(report.runs, [load_eval(out / "eval_sft"), load_eval(out / "eval_rl")])
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    sft_points = lines["sft: evals during training (100 problems)"].get_xdata().tolist()
    rl_points = lines["rl: evals during training (100 problems)"].get_xdata().tolist()
    # Each stage is one axis unit wide, whatever its step count: stage i's step s is at i + s / last_step.
    assert sft_points == pytest.approx([s / SFT_STEPS for s in (250, 500, 750, 1000)])
    assert rl_points == pytest.approx([1 + s / RL_STEPS for s in range(RL_EVAL_EVERY, RL_STEPS + 1, RL_EVAL_EVERY)])
    assert lines["sft: final model, held-out, 60 problems"].get_xdata().tolist() == [1.0]
    assert lines["rl: final model, held-out, 60 problems"].get_xdata().tolist() == [2.0]
    dividers = [line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("_")]
    assert dividers == [1.0]  # the divider between the stages
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "1000 | 0" in labels and labels[-1] == "560" and labels.count("200") == 2  # RL counts from its 0


def test_the_same_prompts_before_and_after(demo_report):
    out, report = demo_report
    page = report.html.read_text()
    expected = json.loads((out / "expected.json").read_text())
    assert f"{N_PROBLEMS} prompts answered by both; fixed: {expected['fixed']}" in page
    assert re.search(r"<summary>fixed: \d+</summary><table class=\"compare\"><tr><th>prompt</th><th>answer</th>"
                     r"<th>after sft</th><th>reward</th><th>after rl</th><th>reward</th>", page)
    assert "&lt;img src=&quot;x&quot; onerror=&quot;alert(1)&quot;&gt;" in page and page.count("<script") == 1
    assert page.count("<img ") == len(report.plots) + 1  # the plots and the headline, nothing from a sample


# ------------------------------------------------------------------------------- the browser


def chromium_or_skip() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if not found:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    return found


CHECK = """(() => {
  const imgs = Array.from(document.images);
  return {
    loaded: document.body.getAttribute("data-images-loaded"),
    broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    sizes: imgs.map(i => [i.naturalWidth, i.naturalHeight]),
    page_errors: document.body.getAttribute("data-errors"),
    table: Array.from(document.querySelectorAll("table.headline tr")).map(r => r.innerText),
    headline_top: document.querySelector("table.headline").getBoundingClientRect().top,
    height: document.documentElement.scrollHeight,
  };
})()"""


class Chromium:
    """Headless Chromium over the DevTools protocol on fds 3 (its input) and 4 (its output):
    JSON messages, each ended by a NUL byte. Its own process group, killed on close."""

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-pipe")

    def __init__(self, binary: str, workdir: Path):
        self.log = workdir / "chromium.log"
        to_child, self._to = os.pipe()
        self._from, from_child = os.pipe()

        def onto_3_and_4() -> None:  # in the child, before exec: whatever numbers the pipes got
            r, w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_child, from_child))
            os.dup2(r, 3)
            os.dup2(w, 4)

        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, *self.FLAGS, f"--user-data-dir={workdir / 'profile'}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=False, preexec_fn=onto_3_and_4,
                start_new_session=True,
            )
        os.close(to_child)
        os.close(from_child)
        self._buf, self._id, self.events = b"", 0, []

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("Browser.close", timeout=10)
                self.proc.wait(timeout=10)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever it left running in its group
            except ProcessLookupError:
                pass
            self.proc.wait()
            os.close(self._to)
            os.close(self._from)

    def _recv(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no answer from chromium; its log: {self.log.read_text()[-800:]}")
            chunk = os.read(self._from, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe; its log: {self.log.read_text()[-800:]}")
            self._buf += chunk
        message, _, self._buf = self._buf.partition(b"\0")
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._recv(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(self._recv(deadline))

    def errors(self) -> list[str]:
        """The page's uncaught exceptions, console errors and error log entries (failed loads)."""
        found = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                found.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                found.append(f"{entry.get('text', '')} {entry.get('url', '')}".strip())
        return found


def render(binary: str, html: Path, workdir: Path, width: int = 1280, height: int = 3000) -> dict:
    """Load `html` in Chromium; the page's state (see CHECK), errors, and two screenshots in `workdir`:
    screenshot.png (the first `height` pixels) and screenshot-full.png (the whole page)."""
    with Chromium(binary, workdir) as browser:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            browser.send(f"{domain}.enable", session=session)
        browser.send("Emulation.setDeviceMetricsOverride",
                     {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        browser.send("Page.navigate", {"url": html.as_uri()}, session)
        browser.wait_for("Page.loadEventFired")
        state = browser.send("Runtime.evaluate", {"expression": CHECK, "returnByValue": True}, session)
        state = state["result"]["value"]
        shot = browser.send("Page.captureScreenshot", {"format": "png"}, session)
        (workdir / "screenshot.png").write_bytes(base64.b64decode(shot["data"]))
        clip = {"x": 0, "y": 0, "width": width, "height": state["height"], "scale": 1}
        full = browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip},
                            session)
        (workdir / "screenshot-full.png").write_bytes(base64.b64decode(full["data"]))
        state["errors"] = browser.errors()
    return state


def test_the_demo_page_in_chromium(demo_report, tmp_path):
    binary = chromium_or_skip()
    _, report = demo_report
    state = render(binary, report.html, tmp_path)
    n_images = len(report.plots) + 1
    assert state["errors"] == [] and state["page_errors"] == "", state
    assert state["broken"] == [] and state["loaded"] == f"{n_images}/{n_images}"
    assert all(w > 300 and h > 200 for w, h in state["sizes"])
    assert [r.split("\t")[0] for r in state["table"]] == ["", "held-out accuracy", "mean reward",
                                                          "mean length (tokens)", "truncation rate"]
    assert state["headline_top"] < 400  # the table is on the first screen

    from PIL import Image

    shot = np.asarray(Image.open(tmp_path / "screenshot.png").convert("RGB"))
    assert shot.shape[:2] == (3000, 1280) and len(np.unique(shot.reshape(-1, 3), axis=0)) > 50
    full = Image.open(tmp_path / "screenshot-full.png")
    assert full.size == (1280, state["height"]) and state["height"] > 3000
    print(f"screenshots: {tmp_path / 'screenshot.png'}, {tmp_path / 'screenshot-full.png'}")


def test_a_broken_image_and_a_script_error_are_caught(tmp_path):
    """The checks themselves: a page with a missing image and a throwing script fails them."""
    binary = chromium_or_skip()
    page = tmp_path / "bad.html"
    page.write_text(f'<!DOCTYPE html><html><head><script>{_page_script()}</script></head><body>'
                    '<img alt="missing" src="missing.png"><table class="headline"><tr><td>x</td></tr></table>'
                    "<script>undefined_function()</script></body></html>")
    state = render(binary, page, tmp_path)
    assert state["broken"] == ["missing"] and state["loaded"] == "0/1"
    assert "failed to load a img" in state["page_errors"] and "undefined_function" in state["page_errors"]
    assert any("undefined_function" in e for e in state["errors"]), state["errors"]
    assert any("missing.png" in e for e in state["errors"]), state["errors"]  # the failed load, in the log


def _page_script() -> str:
    from posttrain.report.html import SCRIPT

    return SCRIPT


def test_eval_markers_and_smoothed_curves(demo_report):
    """Drawn as a dashboard draws them: a long train curve smoothed over its faint raw values, eval points marked."""
    _, report = demo_report
    from posttrain.report.plots import GROUPS, draw_group, ema, ema_weight

    sft = report.runs[0]
    fig = draw_group([sft], GROUPS[1], ["loss"])
    ax = fig.axes[0]
    raw, smoothed, evals = ax.get_lines()
    assert raw.get_alpha() < 0.5 and raw.get_label() == "_raw" and smoothed.get_label() == "train"
    assert np.allclose(smoothed.get_ydata(), ema(sft.metrics["loss"].values, ema_weight(SFT_STEPS)))
    assert evals.get_marker() == "o" and evals.get_xdata().tolist() == sft.metrics[EVAL + "loss"].steps.tolist()
    assert ax.get_title(loc="right") == "EMA 0.9"


def test_the_demo_writes_this_page(tmp_path):
    """`posttrain demo` reports its run and eval directories as the two stages of one pipeline."""
    from posttrain.demo import write_demo_report

    out = write_demo_dir(tmp_path)
    page = write_demo_report(out).read_text()
    assert page.index('<table class="headline">') < page.index('id="plot-report-pipeline-accuracy"')
    assert "Stage: sft</h3>" in page and "Stage: rl</h3>" in page and "prompts answered by both" in page
