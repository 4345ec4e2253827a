"""Asynchronous RL against synchronous: wall seconds per GRPO step on 1 rollout worker + 1 actor
worker (Ray, 1 thread each), with generation and update about equal in time (issue 34).

    PYTHONPATH=src .venv/bin/python benchmarks/async_rl.py --out runs/bench_async [--steps 10] \
        [--max-new-tokens 48] [--rounds 1]

Goal: async ≥ 1.6x the synchronous loop's steps per second; the ceiling is 2x (two stages of
equal length fully overlapped), so speed-up / 2 is the share of the ideal overlap reached.

The workload: `recipes/grpo.yaml` with the built-in `tiny` model (random weights) on the bundled
arithmetic task, trainer.backend=ray with placement.rollout.enable_resource_pool=true (a rollout
worker and an actor worker, each a process of 1 CPU: placement.cpus_per_worker=1), no checkpoints,
no evaluation. The three modes, each in a fresh child process, at equal work (every mode
recomputes the old log-probs: the synchronous run with rollout.calculate_log_probs=true, as the
async ones must for decoupled PPO):
  sync          trainer.async_training.max_staleness=0
  async_k1      max_staleness=1 (mode=fully_async)
  one_step_off  max_staleness=1 mode=one_step_off
Measured from each run's metrics.jsonl after --warmup steps: the median of timing/step, and of
the synchronous run's generation (timing/gen) and update side (old_logprob + ref + adv +
update_actor) to show they are about equal; the async runs' median perf/overlap. The modes
alternate their order over --rounds; the 1-minute load average before and after each run is
recorded (on a machine shared with other jobs, an overlap needs two idle cores to pay).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "sync": ["trainer.async_training.max_staleness=0"],
    "async_k1": ["trainer.async_training.max_staleness=1"],
    "one_step_off": ["trainer.async_training.max_staleness=1", "trainer.async_training.mode=one_step_off"],
}
UPDATE_STAGES = ("old_logprob", "ref", "adv", "update_actor")


def summarise(rows: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Medians over the steps after `warmup`: step, generation, update side, overlap."""
    steps = [r for r in rows if "timing/step" in r][warmup:]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {"step_s": med("timing/step"), "gen_s": med("timing/gen"),
            "update_s": statistics.median(sum(r.get(f"timing/{s}", 0.0) for s in UPDATE_STAGES) for r in steps),
            "overlap": med("perf/overlap"), "steps": float(len(steps))}


def run_mode(mode: str, out: Path, data: Path, args: argparse.Namespace, round_: int) -> dict[str, float]:
    run_dir = out / f"{mode}-{round_}"  # a fresh run directory per run
    argv = [sys.executable, "-m", "posttrain", "grpo", "--config", str(ROOT / "recipes" / "grpo.yaml"),
            "model.path=null", "model.init=tiny", f"data.train_files=[{data / 'train.jsonl'}]",
            "trainer.save_steps=0", "trainer.eval_steps=0", "trainer.report_to=[]", "trainer.progress=false",
            "trainer.overwrite=true", f"trainer.output_dir={run_dir}", f"trainer.max_steps={args.steps}",
            f"data.train_batch_size={args.batch}", f"actor.ppo_mini_batch_size={args.batch}", f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"actor.micro_batch_size={args.batch * args.n}",
            "algorithm.overlong.buffer=0", "rollout.calculate_log_probs=true", "trainer.backend=ray",
            "placement.rollout.enable_resource_pool=true", "placement.cpus_per_worker=1", *MODES[mode]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarise(rows, args.warmup)


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """A markdown table: per mode the median step, its speed-up over sync, gen/update, overlap."""
    med = {m: statistics.median(r["step_s"] for r in rs) for m, rs in results.items()}
    lines = ["| mode | s/step (median) | speed-up vs sync | share of the 2x ideal | gen s | update s | perf/overlap "
             "| load avg (1 min) |", "|---|---|---|---|---|---|---|---|"]
    for mode, rs in results.items():
        speed = med["sync"] / med[mode]
        share = "–" if mode == "sync" else f"{speed / 2:.0%}"
        lines.append(f"| {mode} | {med[mode]:.3f} | {speed:.2f}x | {share} | "
                     f"{statistics.median(r['gen_s'] for r in rs):.3f} | "
                     f"{statistics.median(r['update_s'] for r in rs):.3f} | "
                     f"{statistics.median(r['overlap'] for r in rs):.2f} | "
                     f"{min(r['load_before'] for r in rs):.1f}–{max(r['load_after'] for r in rs):.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    from posttrain.data.tasks import make_task

    data = args.out / "data"
    make_task("arithmetic", data, n_train=64, n_test=4, seed=0, difficulty="easy")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):  # alternate the order over rounds
            before = os.getloadavg()[0]
            results[mode].append({**run_mode(mode, args.out, data, args, r), "load_before": before,
                                  "load_after": os.getloadavg()[0]})
            print(mode, results[mode][-1], flush=True)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    (args.out / "async_rl.json").write_text(json.dumps(record, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
