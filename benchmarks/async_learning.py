"""Learning under asynchronous RL: reward against samples seen on the demo task, async K = 1
against the synchronous loop, over several seeds (issue 34, item 6).

    PYTHONPATH=src .venv/bin/python benchmarks/async_learning.py --demo runs/demo \
        --out runs/bench_async_learning [--seeds 0 1 2] [--steps 100] [--eval-every 25] [--jobs 2]

Goal: async K = 1's final held-out accuracy within the seeds' spread of the synchronous loop's
(its mean inside [min, max] of the synchronous seeds).

The workload is the demo's RL stage (`posttrain demo`, src/posttrain/demo.py): its config is
built by `demo.rl_config` (recipes/grpo.yaml: 16 prompts x 8 samples per step, the demo's RL
prompts data/rl.jsonl), started from the demo's SFT checkpoint (DEMO/sft/final), with these
departures: `--steps` fixed steps and no time budget (the demo stops at 120 s, which would give
the two modes different step counts), `trainer.seed` per seed, and for async K = 1
`trainer.async_training.max_staleness=1` (which records the behaviour log-probs and trains on
decoupled PPO, docs/async.md). The local backend: async K = 1 runs the overlapped pool's
schedule in turn, with the same numbers (tests/trainers/test_rl_async.py), so this measures
what staleness and the objective do to learning, not speed. Each run is a child process with one
torch thread; --jobs run at once.

After training, each run's final model is evaluated as the demo evaluates it (`demo.evaluate_model`:
greedy, every held-out problem of DEMO/data/test.jsonl). Writes OUT/async_learning.json (per run:
the reward curve, the in-run evaluations, the final accuracy), OUT/async_learning.png (reward
and held-out accuracy against samples seen) and prints a markdown table, with the SFT model's
accuracy from the demo's own evaluation (DEMO/eval_sft) when there is one.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "async_k1": ["trainer.async_training.max_staleness=1"]}
SMOOTH = 10  # steps in the reward curve's moving average


def run_one(demo_dir: Path, run_dir: Path, mode: str, seed: int, steps: int, eval_every: int) -> dict[str, Any]:
    """Train one run (in this process) and evaluate its final model; returns its record."""
    from posttrain import demo

    data = {split: demo_dir / "data" / f"{split}.jsonl" for split in ("train", "rl", "test")}
    size = dataclasses.replace(demo.FULL, rl_steps=steps, rl_extra=(
        f"trainer.eval_steps={eval_every}", "eval.num_examples=100", "trainer.max_time_s=null"))
    shared = ["model.device=cpu", "model.dtype=float32", "trainer.resume=never", "trainer.report_to=[]",
              "trainer.overwrite=true", "trainer.progress=false", f"trainer.seed={seed}", *MODES[mode]]
    cfg = demo.rl_config(data, demo_dir / "sft" / "final", run_dir, size, shared)
    t0 = time.perf_counter()
    final = demo.train_rl(cfg)
    wall = time.perf_counter() - t0
    metrics = demo.evaluate_model(final, data["test"], cfg, run_dir / "eval_final", "cpu")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = cfg.data.train_batch_size * cfg.rollout.n
    return {
        "mode": mode, "seed": seed, "steps": steps, "wall_s": round(wall, 1), "samples_per_step": per_step,
        "final_accuracy": metrics["accuracy"], "n_test": int(metrics["num_prompts"]),
        "reward": [r["reward/mean"] for r in rows if "reward/mean" in r and "timing/step" in r],
        "staleness_max": max((r.get("async/staleness/max", 0.0) for r in rows), default=0.0),
        "evals": [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r],
    }


def spawn(args: argparse.Namespace, mode: str, seed: int) -> subprocess.Popen:
    run_dir = args.out / f"{mode}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, __file__, "--demo", str(args.demo), "--out", str(args.out), "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), "--one", mode, str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    log = (run_dir / "run.log").open("w")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (mode, seed) as a child process, at most args.jobs at once; the modes of a seed
    run side by side, so both see the same load."""
    queue = [(m, s) for s in args.seeds for m in MODES]
    running: list[tuple[str, int, subprocess.Popen]] = []
    while queue or running:
        while queue and len(running) < args.jobs:
            mode, seed = queue.pop(0)
            running.append((mode, seed, spawn(args, mode, seed)))
        time.sleep(2)
        for item in [x for x in running if x[2].poll() is not None]:
            running.remove(item)
            mode, seed, proc = item
            if proc.returncode:
                sys.exit(f"{mode} seed {seed} failed (exit {proc.returncode}): see {args.out / f'{mode}-s{seed}' / 'run.log'}")
            print(f"{mode} seed {seed} done", flush=True)
    return [json.loads((args.out / f"{m}-s{s}" / "result.json").read_text()) for s in args.seeds for m in MODES]


def moving_average(xs: list[float], k: int) -> list[float]:
    """Mean of the last k values (fewer at the start): out[i] = mean(xs[max(0, i-k+1) : i+1])."""
    return [statistics.fmean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def verdict(runs: list[dict[str, Any]]) -> tuple[bool, str]:
    """Goal: async K=1's mean final accuracy inside [min, max] of the synchronous seeds'."""
    acc = {m: [r["final_accuracy"] for r in runs if r["mode"] == m] for m in MODES}
    lo, hi, mean = min(acc["sync"]), max(acc["sync"]), statistics.fmean(acc["async_k1"])
    met = lo <= mean <= hi
    return met, (f"async K=1 mean {100 * mean:.1f}% {'inside' if met else 'outside'} the synchronous seeds' "
                 f"spread [{100 * lo:.1f}%, {100 * hi:.1f}%]: goal {'met' if met else 'not met'}")


def table(runs: list[dict[str, Any]]) -> str:
    """Per mode: the final held-out accuracy of each seed, their mean and spread, the mean
    reward over the last SMOOTH steps, the largest staleness trained on, wall seconds."""
    lines = ["| mode | final held-out accuracy per seed | mean | spread (max − min) | reward, last "
             f"{SMOOTH} steps (mean over seeds) | max staleness | wall s per run |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        acc = [r["final_accuracy"] for r in rs]
        lines.append(
            f"| {mode} | {', '.join(f'{100 * a:.1f}%' for a in acc)} | {100 * statistics.fmean(acc):.1f}% | "
            f"{100 * (max(acc) - min(acc)):.1f} pts | "
            f"{statistics.fmean(statistics.fmean(r['reward'][-SMOOTH:]) for r in rs):.3f} | "
            f"{max(r['staleness_max'] for r in rs):.0f} | {statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"sync": "tab:blue", "async_k1": "tab:orange"}
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in runs:
        per = r["samples_per_step"]
        label = f"{r['mode']} seed {r['seed']}"
        ax_r.plot([per * (i + 1) for i in range(len(r["reward"]))], moving_average(r["reward"], SMOOTH),
                  color=colours[r["mode"]], alpha=0.8, label=label)
        ax_a.plot([per * s for s, _ in r["evals"]], [100 * a for _, a in r["evals"]], marker="o",
                  color=colours[r["mode"]], alpha=0.8, label=label)
    ax_r.set(xlabel="samples seen", ylabel=f"reward/mean ({SMOOTH}-step moving average)", title="training reward")
    ax_a.set(xlabel="samples seen", ylabel="held-out accuracy (%), 100 problems", title="in-run evaluations")
    ax_a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", type=Path, default=Path("runs/demo"), help="a `posttrain demo` output folder")
    p.add_argument("--out", type=Path, default=Path("runs/bench_async_learning"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25, help="in-run evaluations (100 held-out problems), as the demo's")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    p.add_argument("--one", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)  # a child: one run
    args = p.parse_args()
    if args.one:
        mode, seed = args.one[0], int(args.one[1])
        run_dir = args.out / f"{mode}-s{seed}"
        record = run_one(args.demo, run_dir, mode, seed, args.steps, args.eval_every)
        (run_dir / "result.json").write_text(json.dumps(record))
        return
    if not (args.demo / "sft" / "final").is_dir():
        sys.exit(f"--demo {args.demo}: no sft/final checkpoint in it; run `posttrain demo --out {args.demo}` first")
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs = run_all(args)
    met, line = verdict(runs)
    record = {"started": started, "ended": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "args": {k: str(v) for k, v in vars(args).items()}, "goal_met": met, "runs": runs}
    (args.out / "async_learning.json").write_text(json.dumps(record, indent=2))
    plot(runs, args.out / "async_learning.png")
    print(table(runs))
    base = args.demo / "eval_sft" / "eval.json"  # the demo's own evaluation of its SFT model, when it ran
    if base.exists():
        print(f"start: the SFT model's held-out accuracy {100 * json.loads(base.read_text())['metrics']['accuracy']:.1f}%")
    print(line)


if __name__ == "__main__":
    main()
