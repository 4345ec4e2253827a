"""Ray backend overhead: the same GRPO workload on the local backend and on Ray (issue 17).

    PYTHONPATH=src .venv/bin/python benchmarks/ray_overhead.py --out runs/bench_ray [--rounds 2] [--steps 15] \
        [--seed-mode row|batch]

Target (issue 17): seconds per GRPO step on Ray (2 workers × 1 thread) ≤ 1.15 × the local
backend's (1 process, 2 torch threads): the same 2 cores either way.

The workload: `recipes/grpo.yaml` with the built-in `tiny` model (`model.init=tiny`, random
weights, so completions mostly run to max_new_tokens) on the bundled arithmetic task
(`make_task("arithmetic", ...)`), no checkpoints, no evaluation, no loggers
(`trainer.save_steps=0 trainer.eval_steps=0 trainer.report_to=[]`); --batch prompts × --n
completions of at most --max-new-tokens tokens per step, --steps steps per run, sampled with
`rollout.seed_mode=--seed-mode` on both sides (default row: Ray then splits generation over its
workers, `rollout.dispatch=auto`, and both sides sample the same tokens; batch: generation on
Ray's worker 0 alone, RANK_ZERO, what the first record measured).

The two sides, each run in its own fresh child process (thread settings and Ray do not leak);
they alternate over --rounds rounds (local first in even rounds):
  local  trainer.backend=local, torch.set_num_threads(2)
  ray    trainer.backend=ray trainer.n_workers_per_node=2 placement.cpus_per_worker=1 (each worker
         sets its torch threads to 1), the driver with 1 thread; Ray on 127.0.0.1, shut down
         by the backend at the end of the run; after each Ray run the new raylets still alive
         after up to 15 s are reported (`pgrep -f ray/raylet/raylet`; none expected).

Measured: the run's own metrics.jsonl (`rl_step`'s stage timer, wall seconds): `timing/step`,
`timing/<stage>` for gen, reward, old_logprob, ref, values, adv, update_critic, update_actor,
other = step − the stages (prompt batch, the weight sync, metrics; on Ray also the fetch
of worker 0's weights into the driver's mirror that `sync_weights(r.actor.model)` reads), and
`throughput/tokens_per_s` (the batch's tokens ÷ the step). The first --warmup steps of each run
are dropped; figures are medians over the remaining steps of all runs of a side; the ratio
Ray ÷ local is the step medians', with the range of the per-round ratios beside it. Beside the
medians, in brackets, each side's best (minimum) step and stages: on a machine shared with
other jobs the median mostly measures the neighbours, the minimum the code.
`--from-json runs/bench_ray/ray_overhead.json` prints the table of a saved run again.

Compute vs communication on Ray: the code has no in-worker timer, so this is an estimate.
A Ray stage's driver-observed time = the workers' compute + dispatch (pickling the batch,
Ray's object store, `ray.get`) + the gloo all-reduces. The local backend runs the same stage on
the same rows on the same 2 cores (2 threads on all rows vs 1 thread on half of them each), so
its time stands in for the workers' compute and
    communication + overhead ≈ Ray stage − local stage
(an upper bound: it also holds the loss of 2-thread vs 2-process parallel efficiency, either
sign). With --seed-mode batch generation is the exception: on Ray it runs on worker 0 alone
with 1 thread, so its compute is ~the local one with 1 thread, not 2; the gap there is mostly
compute, not communication (`RLWorker.generate`, RANK_ZERO).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("gen", "reward", "old_logprob", "ref", "values", "adv", "update_critic", "update_actor")
"""`posttrain.trainers.rl_steps.STAGES` (not imported: the parent process stays light)."""
TARGET = 1.15
BACKENDS = ("local", "ray")
THREADS = {"local": 2, "ray": 1}


# ---------------------------------------------------------------------------- pure parts (tested)


def step_rows(rows: Sequence[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The training steps' metrics rows (those with `timing/step`) after the first `warmup`."""
    steps = [r for r in rows if "timing/step" in r]
    return steps[warmup:]


def row_other(row: dict[str, Any]) -> float:
    return row["timing/step"] - sum(row.get(f"timing/{k}", 0.0) for k in STAGES)


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the (post-warm-up) rows of one side: step, stages (and other), tokens/s;
    and the best (least disturbed by the neighbours) step and stages, each its own minimum."""
    if not rows:
        raise ValueError("no steps to aggregate (all warm-up?)")
    med = statistics.median
    stages = {k: med(r.get(f"timing/{k}", 0.0) for r in rows) for k in STAGES}
    stages["other"] = med(row_other(r) for r in rows)
    tps = [r["throughput/tokens_per_s"] if "throughput/tokens_per_s" in r else r["num_tokens"] / r["timing/step"]
           for r in rows]
    best = {k: min(r.get(f"timing/{k}", 0.0) for r in rows) for k in STAGES}
    best["other"] = min(row_other(r) for r in rows)
    return {"step": med(r["timing/step"] for r in rows), "stages": stages, "tokens_per_s": med(tps),
            "steps": len(rows), "step_best": min(r["timing/step"] for r in rows), "stages_best": best}


def verdict(ratio: float, target: float = TARGET) -> str:
    return "PASS" if ratio <= target else "FAIL"


def summarize(runs: Sequence[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """`runs`: [{"backend", "round", "rows"}] → per side aggregates, the ratio, per-round ratios,
    the compute/communication estimate per stage (module doc)."""
    sides: dict[str, Any] = {}
    for b in BACKENDS:
        mine = [r for r in runs if r["backend"] == b]
        pooled = [row for r in mine for row in step_rows(r["rows"], warmup)]
        sides[b] = aggregate(pooled)
        sides[b]["per_round"] = {r["round"]: aggregate(step_rows(r["rows"], warmup))["step"] for r in mine}
    local, ray = sides["local"], sides["ray"]
    ratio = ray["step"] / local["step"]
    rounds = sorted(set(local["per_round"]) & set(ray["per_round"]))
    per_round = [ray["per_round"][i] / local["per_round"][i] for i in rounds]
    comm = {k: ray["stages"][k] - local["stages"][k] for k in (*STAGES, "other")}
    return {**sides, "ratio": ratio, "ratio_per_round": per_round, "ratio_best": ray["step_best"] / local["step_best"], "target": TARGET, "verdict": verdict(ratio),
            "ray_minus_local": comm}


def table(summary: dict[str, Any]) -> str:
    local, ray, d = summary["local"], summary["ray"], summary["ray_minus_local"]
    per = summary["ratio_per_round"]
    spread = f" [{min(per):.2f}–{max(per):.2f}]" if per else ""
    lines = [
        "| | local (1 process, 2 threads) | Ray (2 workers × 1 thread) | Ray − local | Ray ÷ local |",
        "|---|---|---|---|---|",
        f"| **s/step** (median) | {local['step']:.3f} | {ray['step']:.3f} | {ray['step'] - local['step']:+.3f} "
        f"| **{summary['ratio']:.2f}x**{spread} |",
    ]
    for k in (*STAGES, "other"):
        lo, ra = local["stages"][k], ray["stages"][k]
        if lo < 1e-4 and ra < 1e-4:
            continue  # a stage this workload does not run
        r = f"{ra / lo:.2f}x" if lo > 1e-4 else "–"
        lb, rb = local["stages_best"][k], ray["stages_best"][k]
        lines.append(f"| {k} (s): median (best) | {lo:.3f} ({lb:.3f}) | {ra:.3f} ({rb:.3f}) | {d[k]:+.3f} | {r} "
                     f"({rb / lb:.2f}x) |" if lb > 1e-4 else f"| {k} (s): median (best) | {lo:.3f} ({lb:.3f}) | "
                     f"{ra:.3f} ({rb:.3f}) | {d[k]:+.3f} | {r} |")
    lines.append(f"| s/step, best step (least disturbed) | {local['step_best']:.3f} | {ray['step_best']:.3f} "
                 f"| {ray['step_best'] - local['step_best']:+.3f} | {summary['ratio_best']:.2f}x |")
    lines.append(f"| tokens/s | {local['tokens_per_s']:.0f} | {ray['tokens_per_s']:.0f} | – "
                 f"| {ray['tokens_per_s'] / local['tokens_per_s']:.2f}x |")
    lines.append(f"| steps measured | {local['steps']} | {ray['steps']} | – | – |")
    lines.append("")
    lines.append(f"Ray ÷ local = {summary['ratio']:.2f} (target ≤ {summary['target']:.2f}): **{summary['verdict']}**; "
                 f"best steps: {summary['ratio_best']:.2f} ({verdict(summary['ratio_best'], summary['target'])})")
    return "\n".join(lines)


def comm_estimate(summary: dict[str, Any]) -> str:
    """Ray's step split (module doc): communication/dispatch ≈ Ray − local over the dispatched
    stages and 'other', each clipped at 0; compute ≈ the rest of Ray's step."""
    ray, d = summary["ray"], summary["ray_minus_local"]
    dispatched = ("old_logprob", "ref", "values", "update_critic", "update_actor", "other")
    comm = sum(max(d[k], 0.0) for k in dispatched)
    return (f"Ray step {ray['step']:.3f} s ≈ compute {ray['step'] - comm:.3f} s + communication/dispatch "
            f"≤≈ {comm:.3f} s ({100 * comm / ray['step']:.0f}%; Ray − local over the dispatched stages and "
            f"'other', each clipped at 0; a negative difference means the 2 one-thread workers out-ran "
            f"2 threads in one process, hiding that stage's communication)")


# ---------------------------------------------------------------------------- the runs


def cli_args(backend: str, data: Path, run: Path, args: argparse.Namespace) -> list[str]:
    out = ["grpo", "--config", str(ROOT / "recipes" / "grpo.yaml"), "model.path=null", "model.init=tiny",
           f"data.train_files=[{data / 'train.jsonl'}]", f"data.eval_files=[{data / 'test.jsonl'}]",
           "eval.task=arithmetic", "eval.num_examples=2",
           f"data.train_batch_size={args.batch}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
           f"actor.micro_batch_size={args.batch * args.n}", f"trainer.max_steps={args.steps}",
           "trainer.save_steps=0", "trainer.eval_steps=0", "trainer.report_to=[]", "trainer.progress=false",
           f"trainer.output_dir={run}", f"trainer.backend={backend}", f"rollout.seed_mode={args.seed_mode}"]
    if backend == "ray":
        out += ["trainer.nnodes=1", "trainer.n_workers_per_node=2", "placement.cpus_per_worker=1"]
    return out


def child(backend: str, cli: list[str]) -> int:
    import torch

    torch.set_num_threads(THREADS[backend])
    torch.manual_seed(0)
    from posttrain.cli import main as cli_main

    return cli_main(cli)


def raylets() -> set[str]:
    """Pids of live raylets (`pgrep -f`, the binary's path)."""
    p = subprocess.run(["pgrep", "-f", "ray/raylet/raylet"], capture_output=True, text=True)
    return set(p.stdout.split())


def raylets_left(before: set[str], seconds: float = 15.0) -> list[str]:
    """The raylets not in `before` still alive after up to `seconds` (the raylet exits a few
    seconds after `ray.shutdown()` returns)."""
    deadline = time.time() + seconds
    while (left := raylets() - before) and time.time() < deadline:
        time.sleep(0.5)
    return sorted(left)


def machine() -> dict[str, Any]:
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in lscpu.splitlines() if ln.startswith("Flags")), "")
    return {"cpu": model, "avx512": "avx512f" in flags, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_ray")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (rollout.n)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed-mode", choices=("row", "batch"), default="row",
                   help="rollout.seed_mode on both sides (row: Ray splits generation over its workers)")
    p.add_argument("--from-json", help="print the table of a saved ray_overhead.json again (no runs)")
    p.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--cli", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.exit(child(args.child, json.loads(args.cli)))
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        summary = summarize(saved["runs"], saved["args"]["warmup"])
        print(table(summary) + "\n\n" + comm_estimate(summary))
        return

    from posttrain.data.tasks import make_task

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    make_task("arithmetic", data, n_train=256, n_test=8, seed=0)
    info = {**machine(), "args": vars(args)}
    runs, leftovers = [], []
    for rnd in range(args.rounds):
        order = BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]
        for backend in order:
            run = out / f"{backend}-{rnd}"
            cli = cli_args(backend, data, run, args)
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(THREADS[backend]),
                   "RAY_USAGE_STATS_ENABLED": "0"}
            before = raylets()
            t0 = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--child", backend, "--cli", json.dumps(cli)], env=env,
                           check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            left = raylets_left(before) if backend == "ray" else []
            leftovers += left
            runs.append({"backend": backend, "round": rnd, "rows": rows, "process_s": wall})
            print(f"round {rnd} {backend}: {wall:.1f} s process, raylets left: {left or 'none'}", flush=True)
    summary = summarize(runs, args.warmup)
    info["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    info["raylets_left"] = leftovers
    print(f"\n{info['cpu']} (AVX-512: {'yes' if info['avx512'] else 'no'}), {info['cores']} cores, torch "
          f"{info['torch']}, {info['date']}\nload before: {info['uptime']}\nload after:  {info['uptime_after']}\n")
    print(table(summary))
    print("\n" + comm_estimate(summary))
    print(f"raylets left after the Ray runs: {leftovers or 'none'}")
    (out / "ray_overhead.json").write_text(json.dumps(
        {**info, "summary": summary, "runs": [{k: v for k, v in r.items()} for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
