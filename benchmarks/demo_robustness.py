"""Demo robustness benchmark: `posttrain demo` over seeds × torch thread counts (issue 16).

One and two threads take different float paths through the CPU kernels, as a different CPU
does, and the seeds (the demo's data and both trainers' `trainer.seed`) show the spread. Each
run is its own process, with OMP_NUM_THREADS and MKL_NUM_THREADS set and
`torch.set_num_threads` called before anything else, into OUT/seed{S}-threads{T}/ (its log
beside it, OUT/seed{S}-threads{T}.log). The table (printed, and written as OUT/results.md and
OUT/results.json with the machine) has the held-out accuracy after SFT and after RL, the
gain, the demo's stage seconds (its summary.json) and the process's wall time, which adds
interpreter start-up and imports to the demo's own total and is what the target counts.

Target (issue 16): the minimum gain over the runs is >= +10 points and the slowest run takes
<= 600 s.

    python benchmarks/demo_robustness.py                         # 3 seeds x {1, 2} threads
    python benchmarks/demo_robustness.py --quick --seeds 0 --threads 1   # smoke test only
    python benchmarks/demo_robustness.py --isa native avx2       # and again on AVX2 kernels

`--isa avx2` runs the demo on the kernels a CPU without AVX-512 (an AMD EPYC before Zen 4)
takes: the child gets ATEN_CPU_CAPABILITY=avx2 (torch's own vectorised kernels),
MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's GEMMs) and ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN). On an
AVX-512 machine this is an emulation of the float paths, not of the speed: the same core
runs AVX2 code at its own clock and cache sizes, so its wall times say what AVX2 costs on
this CPU, not what an AMD machine takes. Runs are named seed{S}-threads{T}-avx2.

Runs go one at a time by default: runs sharing the cores slow each other down, so their wall
times no longer say what one run on the machine takes. `--parallel K` runs K at once anyway.
A run that fails is recorded with the tail of its log and the others go on; the exit code is
1 when any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

MIN_GAIN_POINTS = 10.0
MAX_WALL_SECONDS = 600.0
# The kernels of a CPU without AVX-512, forced on this one (see the module docstring).
ISA_ENV = {"native": {},
           "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
STAGES = ("data", "sft", "eval_sft", "rl", "eval_rl", "report")
ERROR_TAIL_LINES = 20

# The child: threads first (before torch does any work), then the CLI's demo command.
CHILD = (
    "import sys, torch; torch.set_num_threads(int(sys.argv[1])); "
    "from posttrain.cli import main; sys.exit(main(sys.argv[2:]))"
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo_robustness", help="one directory per run, and the results")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts")
    p.add_argument("--isa", nargs="+", default=["native"], choices=sorted(ISA_ENV),
                   help="kernels: native (this CPU's best) and/or avx2 (as without AVX-512)")
    p.add_argument("--quick", action="store_true", help="the demo's --quick size: proves the script runs, no more")
    p.add_argument("--parallel", type=int, default=1, metavar="K", help="run K demos at once (default 1)")
    p.add_argument("--device", default="cpu", help="the demo's --device (default cpu: the target is a CPU's)")
    args = p.parse_args()
    if args.parallel > 1:
        print(f"warning: --parallel {args.parallel}: runs share the cores, so their wall times say less "
              "about one run on this machine", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # One kernel set and thread count after the other.
    jobs = [(s, t, isa) for isa in args.isa for t in args.threads for s in args.seeds]

    done: list[dict[str, Any]] = []

    def one(job: tuple[int, int, str]) -> dict[str, Any]:
        row = run_one(out, *job, quick=args.quick, device=args.device)
        done.append(row)
        print(f"{len(done)}/{len(jobs)} " + progress_line(row), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        rows = list(pool.map(one, jobs))
    summary = summarize(rows)
    results = {"machine": machine_info(), "quick": args.quick, "parallel": args.parallel,
               "device": args.device, "target": {"min_gain_points": MIN_GAIN_POINTS,
                                                  "max_wall_seconds": MAX_WALL_SECONDS},
               "runs": rows, "summary": summary}
    text = format_results(results)
    print("\n" + text, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(text + "\n", encoding="utf-8")
    print(f"\nresults: {out / 'results.md'}, {out / 'results.json'}")
    return 1 if summary["failed"] else 0


# ---------------------------------------------------------------------------- one run


def run_name(seed: int, threads: int, isa: str = "native") -> str:
    return f"seed{seed}-threads{threads}" + ("" if isa == "native" else f"-{isa}")


def child_env(threads: int, base: dict[str, str] | None = None, isa: str = "native") -> dict[str, str]:
    """The parent's environment with the thread count and kernels (`ISA_ENV`) pinned, and
    this checkout's posttrain first on the path, so that the child runs the same code as the
    parent."""
    import posttrain

    env = dict(os.environ if base is None else base)
    for key in {k for kernels in ISA_ENV.values() for k in kernels}:
        env.pop(key, None)  # native means native, whatever the parent's shell set
    env.update(ISA_ENV[isa])
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    src = str(Path(posttrain.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_one(out: Path, seed: int, threads: int, isa: str, quick: bool, device: str) -> dict[str, Any]:
    """Run the demo in a fresh process into OUT/<run_name>; returns its table row."""
    name = run_name(seed, threads, isa)
    run_dir, log = out / name, out / f"{name}.log"
    cmd = [sys.executable, "-c", CHILD, str(threads), "demo", "--out", str(run_dir),
           "--seed", str(seed), "--device", device, *(["--quick"] if quick else [])]
    t0 = time.perf_counter()
    with log.open("w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, env=child_env(threads, isa=isa), stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    return make_row(seed, threads, rc, wall, run_dir / "summary.json", log, isa)


def make_row(seed: int, threads: int, rc: int, wall: float, summary_file: Path, log: Path,
             isa: str = "native") -> dict[str, Any]:
    """A run's row: its accuracies, gain (points) and seconds from summary.json, or, when the
    process failed or wrote no summary, `failed` with the tail of its log."""
    row: dict[str, Any] = {"seed": seed, "threads": threads, "isa": isa, "returncode": rc,
                           "process_seconds": round(wall, 1), "log": str(log)}
    if rc != 0 or not summary_file.is_file():
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-ERROR_TAIL_LINES:] \
            if log.is_file() else []
        return {**row, "failed": True, "error_tail": "\n".join(tail) or f"exit code {rc}, no summary.json"}
    s = json.loads(summary_file.read_text(encoding="utf-8"))
    return {**row, "failed": False,
            "sft_accuracy": s["sft_accuracy"], "rl_accuracy": s["rl_accuracy"],
            "gain_points": round(100 * (s["rl_accuracy"] - s["sft_accuracy"]), 2),
            "stage_seconds": s["stage_seconds"], "demo_seconds": s["wall_seconds"]}


def progress_line(row: dict[str, Any]) -> str:
    head = f"[{run_name(row['seed'], row['threads'], row['isa'])}] "
    if row["failed"]:
        last = row["error_tail"].splitlines()[-1] if row["error_tail"] else ""
        return head + f"FAILED (exit {row['returncode']}) after {row['process_seconds']:.0f} s: {last}"
    return head + (f"SFT {100 * row['sft_accuracy']:.1f}% -> RL {100 * row['rl_accuracy']:.1f}% "
                   f"({row['gain_points']:+.1f} pts) in {row['process_seconds']:.0f} s")


# ---------------------------------------------------------------------------- results


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and min gain (points) and the slowest process wall over the runs that finished,
    and the verdict: PASS when every run finished, min gain >= MIN_GAIN_POINTS and the
    slowest run <= MAX_WALL_SECONDS."""
    ok = [r for r in rows if not r["failed"]]
    failed = [run_name(r["seed"], r["threads"], r["isa"]) for r in rows if r["failed"]]
    if not ok:
        return {"runs": len(rows), "failed": failed, "mean_gain_points": None, "min_gain_points": None,
                "slowest_seconds": None, "slowest_run": None, "verdict": "FAIL"}
    gains = [r["gain_points"] for r in ok]
    slowest = max(ok, key=lambda r: r["process_seconds"])
    passed = not failed and min(gains) >= MIN_GAIN_POINTS and slowest["process_seconds"] <= MAX_WALL_SECONDS
    return {"runs": len(rows), "failed": failed,
            "mean_gain_points": round(sum(gains) / len(gains), 2), "min_gain_points": min(gains),
            "slowest_seconds": slowest["process_seconds"],
            "slowest_run": run_name(slowest["seed"], slowest["threads"], slowest["isa"]),
            "verdict": "PASS" if passed else "FAIL"}


def format_results(results: dict[str, Any]) -> str:
    """The Markdown of results.md (also what is printed): machine, table, summary."""
    m, s = results["machine"], results["summary"]
    lines = [f"Machine: {m['cpu_model']} ({'AVX-512' if m['avx512f'] else 'no AVX-512'}), "
             f"{m['cores']} cores, torch {m['torch']}, {m['date']}"
             + ("  \n**--quick: a smoke test, its numbers mean nothing**" if results["quick"] else ""),
             "",
             "| seed | threads | kernels | SFT | RL | gain (pts) | " + " | ".join(STAGES) + " | demo s | process s |",
             "|" + "---|" * (len(STAGES) + 8)]
    for r in results["runs"]:
        if r["failed"]:
            cells = [f"FAILED (exit {r['returncode']})", "", ""] + [""] * len(STAGES) + ["", f"{r['process_seconds']:.1f}"]
        else:
            cells = [f"{100 * r['sft_accuracy']:.1f}%", f"{100 * r['rl_accuracy']:.1f}%", f"{r['gain_points']:+.1f}",
                     *(f"{r['stage_seconds'].get(k, 0.0):.1f}" for k in STAGES),
                     f"{r['demo_seconds']:.1f}", f"{r['process_seconds']:.1f}"]
        lines.append(f"| {r['seed']} | {r['threads']} | {r['isa']} | " + " | ".join(cells) + " |")
    lines.append("")
    if s["min_gain_points"] is not None:
        lines.append(f"Gain: mean {s['mean_gain_points']:+.1f}, min {s['min_gain_points']:+.1f} points "
                     f"(target min >= +{MIN_GAIN_POINTS:.0f}). Slowest run: {s['slowest_run']}, "
                     f"{s['slowest_seconds']:.0f} s (target <= {MAX_WALL_SECONDS:.0f} s).")
    if s["failed"]:
        lines.append(f"Failed: {', '.join(s['failed'])} (see their logs under the output directory).")
    lines.append(f"**{s['verdict']}**" + (" (--quick: not the target's size)" if results["quick"] else ""))
    for r in results["runs"]:
        if r["failed"]:
            lines += ["", f"{run_name(r['seed'], r['threads'], r['isa'])}, last lines of {r['log']}:", "```",
                      r["error_tail"], "```"]
    return "\n".join(lines)


def machine_info(lscpu: str | None = None) -> dict[str, Any]:
    """CPU model and AVX-512 (`lscpu`'s "Model name" and flags), cores, torch, date (UTC)."""
    if lscpu is None:
        try:
            lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        except OSError:
            lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return {"cpu_model": fields.get("Model name") or platform.processor() or "unknown",
            "avx512f": "avx512f" in fields.get("Flags", "").split(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": version("torch"),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


if __name__ == "__main__":
    sys.exit(main())
