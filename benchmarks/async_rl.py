"""Asynchronous RL against synchronous: wall seconds per GRPO step on 1 rollout worker + 1 actor
worker (Ray, 1 thread each), with generation and update about equal in time (issue 34).

    PYTHONPATH=src .venv/bin/python benchmarks/async_rl.py --out runs/bench_async [--steps 10] \
        [--max-new-tokens 48] [--rounds 3] [--workers 1] [--batches 4] [--modes sync async_k1 one_step_off]

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
Measured from each run's metrics.jsonl after --warmup steps, medians over the steps:
  step_s    timing/step
  gen_s     timing/gen (in the async runs: the driver's wait for the batch, not the generation)
  update_s  the driver's work from the batch to the update's end: reward + old_logprob + ref +
            adv + update_actor
  sync_s    the rest of the step, step_s - gen_s - update_s: in a synchronous run the weight
            sync (actor worker 0 -> rollout workers) and the driver's bookkeeping
  overlap   perf/overlap
The synchronous runs' gen_s, update_s and sync_s are the stage times `benchmarks/async_sim.py`
fits and simulates. The table gives per point (workers, batch, mode) the median over --rounds
runs of each run's median step and its spread (min-max over the rounds); the modes alternate
their order over the rounds. The 1-minute load average before and after each run is recorded
(on a machine shared with other jobs, an overlap needs two idle cores to pay).

--workers W runs W rollout workers + W actor workers (placement.rollout.n_workers_per_node=W,
trainer.n_workers_per_node=W; ray.num_cpus=2W, so on a 2-core machine W=2 places 4 one-thread
workers on 2 cores: contended). --batches sets data.train_batch_size (prompts; rows = batch x n).
Every (workers, batch, mode) is run --rounds times; OUT/async_rl.json holds every run.
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
UPDATE_STAGES = ("reward", "old_logprob", "ref", "adv", "update_actor")


def summarise(rows: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Medians over the steps after `warmup` of step_s, gen_s, update_s, sync_s, overlap (see
    the module docstring)."""
    steps = [r for r in rows if "timing/step" in r][warmup:]
    update = [sum(r.get(f"timing/{s}", 0.0) for s in UPDATE_STAGES) for r in steps]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {"step_s": med("timing/step"), "gen_s": med("timing/gen"), "update_s": statistics.median(update),
            "sync_s": statistics.median(r["timing/step"] - r.get("timing/gen", 0.0) - u for r, u in zip(steps, update)),
            "overlap": med("perf/overlap"), "steps": float(len(steps))}


def run_mode(mode: str, out: Path, data: Path, args: argparse.Namespace, round_: int, workers: int,
             batch: int) -> dict[str, float]:
    run_dir = out / f"w{workers}-b{batch}-{mode}-{round_}"  # a fresh run directory per run
    argv = [sys.executable, "-m", "posttrain", "grpo", "--config", str(ROOT / "recipes" / "grpo.yaml"),
            "model.path=null", "model.init=tiny", f"data.train_files=[{data / 'train.jsonl'}]",
            "trainer.save_steps=0", "trainer.eval_steps=0", "trainer.report_to=[]", "trainer.progress=false",
            "trainer.overwrite=true", f"trainer.output_dir={run_dir}", f"trainer.max_steps={args.steps}",
            f"data.train_batch_size={batch}", f"actor.ppo_mini_batch_size={batch}", f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"actor.micro_batch_size={batch * args.n}",
            "algorithm.overlong.buffer=0", "rollout.calculate_log_probs=true", "trainer.backend=ray",
            "placement.rollout.enable_resource_pool=true", "placement.cpus_per_worker=1",
            f"placement.rollout.n_workers_per_node={workers}", f"trainer.n_workers_per_node={workers}",
            f"ray.num_cpus={2 * workers}", *MODES[mode]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = run_dir / "final" / "model.safetensors"  # the bytes one weight sync moves to each rollout worker
    return {**summarise(rows, args.warmup), "weight_bytes": float(weights.stat().st_size) if weights.exists() else 0.0}


def table(runs: list[dict[str, Any]]) -> str:
    """A markdown table: per (workers, batch, mode) the median over the rounds of the runs'
    median step, its spread (min-max), the speed-up over sync at that point, the stage times
    and perf/overlap (medians over the rounds)."""
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workers"], r["batch"], r["mode"]), []).append(r)
    med = {key: statistics.median(r["step_s"] for r in rs) for key, rs in groups.items()}
    lines = ["| workers | batch | mode | rounds | s/step (median) | spread (min–max) | speed-up vs sync | share of the "
             "2x ideal | gen s | update s | sync s | perf/overlap | load avg (1 min) |", "|---" * 13 + "|"]
    for (w, b, mode), rs in groups.items():
        m = lambda k, rs=rs: statistics.median(r[k] for r in rs)  # noqa: E731
        sync = med.get((w, b, "sync"))
        speed = f"{sync / med[(w, b, mode)]:.2f}x" if sync else "–"
        share = f"{sync / med[(w, b, mode)] / 2:.0%}" if sync and mode != "sync" else "–"
        lines.append(f"| {w}+{w} | {b} | {mode} | {len(rs)} | {med[(w, b, mode)]:.3f} | "
                     f"{min(r['step_s'] for r in rs):.3f}–{max(r['step_s'] for r in rs):.3f} | {speed} | {share} | "
                     f"{m('gen_s'):.3f} | {m('update_s'):.3f} | {m('sync_s'):.3f} | {m('overlap'):.2f} | "
                     f"{min(r['load_before'] for r in rs):.1f}–{max(r['load_after'] for r in rs):.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[4], help="prompts per step (data.train_batch_size)")
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="W: W rollout + W actor workers")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    from posttrain.data.tasks import make_task

    data = args.out / "data"
    make_task("arithmetic", data, n_train=64, n_test=4, seed=0, difficulty="easy")
    runs: list[dict[str, Any]] = []
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for r in range(args.rounds):
        for w in args.workers:
            for b in args.batches:
                for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):  # alternate the order over rounds
                    before = os.getloadavg()[0]
                    run = run_mode(mode, args.out, data, args, r, w, b)
                    runs.append({"workers": w, "batch": b, "rows": b * args.n, "mode": mode, "round": r, **run,
                                 "load_before": before, "load_after": os.getloadavg()[0]})
                    print(json.dumps(runs[-1]), flush=True)
    record = {"started": started, "ended": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpus": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    (args.out / "async_rl.json").write_text(json.dumps(record, indent=2))
    print(table(runs))


if __name__ == "__main__":
    main()
