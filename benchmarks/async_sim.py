"""A projection of asynchronous RL at scale: a discrete-event simulator of the synchronous loop
and of async K (one-step-off is K = 1: the same schedule), fed with stage times measured by
`benchmarks/async_rl.py` (issue 34, item 6).

    PYTHONPATH=src .venv/bin/python benchmarks/async_sim.py runs/bench_async/async_rl.json \
        [--cores 2] [--project 8 64] [--rows-per-worker 16]

The schedule simulated is the trainer's (`trainers/rl_async.py`, docs/async.md). The rollout
pool runs one job at a time, in submission order (the lane): generations and weight syncs. The
driver, at step s: submits the generation of steps up to s + K, waits for step s's batch, runs
the update side (reward, old and reference log-probs, advantages, the actor's update) on the
actor pool, then queues the weight sync behind the generations in flight. K = 0 is the
synchronous loop: generation, update, sync, in turn.

Stage times, fitted by least squares on the synchronous runs of the measurement (R rows =
prompts x n per step, W workers per pool, B bytes of weights):

    generation  t_gen(R, W)  = a + b·R/W          (W rollout workers share the rows)
    update side t_upd(R, W)  = c + d·R/W          (W actor workers share the rows)
    weight sync t_sync(W)    = e + f·W·B          (each rollout worker receives the weights)

Cores: a pool of W one-thread workers needs W cores. When the busy workers outnumber the
`cores` (a 2-core machine running 2 + 2 workers, or 1 + 1 beside other jobs), every busy job
runs at cores / busy workers of its speed (processor sharing). The projection at 8 and 64
workers gives each worker a core of its own.

Two projections per size N: (a) the measured layout, N/2 rollout + N/2 actor workers, sync
against async (what async_rl.py measures); (b) the synchronous loop colocated on all N workers
(each stage on N workers, veRL's hybrid engine; its engines take the weights in place, counted
as 0 s, in its favour) against async on N/2 + N/2: the comparison at equal hardware. Rows per step grow with the workers (--rows-per-worker rows per rollout worker)
so each worker keeps the measured amount of work.

Limits: a and c absorb the driver's per-step costs; the sync fit has only the measured worker
counts (one model size: f is the cost per rollout worker's copy); no network (the measured
workers share one machine).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Stages:
    """Seconds of one step's stages at full speed, and the workers each pool keeps busy."""

    gen: float  # one batch's generation on the rollout pool
    update: float  # the update side on the actor pool
    sync: float  # one weight sync, on the rollout pool
    rollout_workers: int = 1
    actor_workers: int = 1


def simulate(st: Stages, steps: int, k: int, cores: float = math.inf) -> list[float]:
    """End times of steps 1..steps under max_staleness `k` (0: the synchronous loop).

    Events: the rollout lane runs its FIFO of jobs (("gen", s) or ("sync", s)) one at a time;
    the driver waits for ("gen", s), then updates. Busy jobs share `cores`: each runs at
    min(1, cores / busy workers) of its speed."""
    lane: deque[list[Any]] = deque()  # [kind, step, seconds of work left]
    done_gen: set[int] = set()
    ends: list[float] = []
    submitted, now, step, update_left = 0, 0.0, 1, None  # update_left: None = waiting for the batch

    def fill(s: int) -> None:
        nonlocal submitted
        while submitted < min(s + k, steps):
            submitted += 1
            lane.append(["gen", submitted, st.gen])

    fill(1)
    while step <= steps:
        if update_left is None and step in done_gen:
            update_left = st.update
        busy = (st.rollout_workers if lane else 0) + (st.actor_workers if update_left is not None else 0)
        assert busy, "deadlock: the driver waits for a batch nobody generates"
        rate = min(1.0, cores / busy)
        left = ([lane[0][2]] if lane else []) + ([update_left] if update_left is not None else [])
        dt = min(left) / rate
        now += dt
        if lane:
            lane[0][2] -= dt * rate
        if update_left is not None:
            update_left -= dt * rate
        if lane and lane[0][2] <= 1e-12:
            kind, s, _ = lane.popleft()
            if kind == "gen":
                done_gen.add(s)
        if update_left is not None and update_left <= 1e-12:
            ends.append(now)
            lane.append(["sync", step, st.sync])
            step, update_left = step + 1, None
            fill(step)
    return ends


def step_time(st: Stages, k: int, cores: float = math.inf, steps: int = 20) -> float:
    """Steady-state seconds per step: the mean over the middle `steps` steps of a 3·steps-step
    run (the first fill and the last steps, which have nothing left to overlap, left out)."""
    ends = simulate(st, 3 * steps, k, cores)
    return (ends[2 * steps - 1] - ends[steps - 1]) / steps


def speedup(st: Stages, k: int, cores: float = math.inf) -> float:
    """Synchronous seconds per step over async K's, on the same pools."""
    return step_time(st, 0, cores) / step_time(st, k, cores)


# ----------------------------------------------------------------------------- fitting


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = p + q·x; one distinct x gives q = 0, p = mean(y)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    q = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    return my - q * mx, q


@dataclass(frozen=True)
class StageModel:
    """The fitted stage times (module docstring): gen = a + b·R/W, update = c + d·R/W,
    sync = e + f·W·B."""

    a: float
    b: float
    c: float
    d: float
    e: float
    f: float
    weight_bytes: float

    def stages(self, rows: float, rollout_workers: int, actor_workers: int, serial_sync: bool = True) -> Stages:
        """The stages at R = `rows`; `serial_sync=False`: the rollout workers take their copies at
        once (sync = e + f·B, as with one copy), else one after another (e + f·W·B)."""
        copies = rollout_workers if serial_sync else 1
        return Stages(gen=self.a + self.b * rows / rollout_workers, update=self.c + self.d * rows / actor_workers,
                      sync=self.e + self.f * copies * self.weight_bytes,
                      rollout_workers=rollout_workers, actor_workers=actor_workers)


def fit(runs: list[dict[str, Any]]) -> StageModel:
    """Fit on the synchronous runs of async_rl.json (each run's median stage times)."""
    sync = [r for r in runs if r["mode"] == "sync"]
    per_worker = [r["rows"] / r["workers"] for r in sync]
    a, b = fit_line(per_worker, [r["gen_s"] for r in sync])
    c, d = fit_line(per_worker, [r["update_s"] for r in sync])
    weight_bytes = max(r["weight_bytes"] for r in sync)
    e, f = fit_line([r["workers"] * weight_bytes for r in sync], [r["sync_s"] for r in sync])
    return StageModel(a, b, c, d, e, f, weight_bytes)


# ----------------------------------------------------------------------------- report


def check_table(runs: list[dict[str, Any]], model: StageModel, cores: float) -> str:
    """Measured against simulated seconds per step at every measured point (median over rounds)."""
    points: dict[tuple[int, int, str], list[float]] = {}
    for r in runs:
        points.setdefault((r["workers"], r["rows"], r["mode"]), []).append(r["step_s"])
    lines = ["| workers | rows | mode | measured s/step (median, min–max) | simulated s/step | simulated / measured |",
             "|---|---|---|---|---|---|"]
    for (w, rows, mode), xs in sorted(points.items()):
        sim = step_time(model.stages(rows, w, w), 0 if mode == "sync" else 1, cores)
        med = statistics.median(xs)
        lines.append(f"| {w}+{w} | {rows} | {mode} | {med:.3f} ({min(xs):.3f}–{max(xs):.3f}) | {sim:.3f} | {sim / med:.2f} |")
    return "\n".join(lines)


def projection_table(model: StageModel, sizes: list[int], rows_per_worker: float) -> str:
    """Simulated speed-ups of async K=1 at N workers, each with a core of its own, under both
    sync models (the weights reach the N/2 rollout workers one after another, or at once)."""
    lines = ["| workers N | rows/step | weight sync | gen s | update s | sync s | (a) async N/2+N/2 vs sync N/2+N/2 | "
             "(b) async N/2+N/2 vs sync colocated on N |", "|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        half, rows = n // 2, rows_per_worker * (n // 2)
        colocated = model.stages(rows, n, n)
        sync_colocated = colocated.gen + colocated.update  # in turn; in-place weights: sync 0, in its favour
        for serial in (True, False):
            split = model.stages(rows, half, half, serial)
            lines.append(f"| {n} | {rows:.0f} | {'one after another' if serial else 'at once'} | {split.gen:.3f} | "
                         f"{split.update:.3f} | {split.sync:.3f} | {speedup(split, 1):.2f}x | "
                         f"{sync_colocated / step_time(split, 1):.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("measured", type=Path, nargs="+", help="async_rl.json files of benchmarks/async_rl.py")
    p.add_argument("--cores", type=float, default=2.0, help="cores of the measuring machine")
    p.add_argument("--project", type=int, nargs="+", default=[8, 64], help="total workers N to project to")
    p.add_argument("--rows-per-worker", type=float, default=None,
                   help="rows per rollout worker at scale (default: the measured points' largest)")
    args = p.parse_args()
    runs = [r for path in args.measured for r in json.loads(path.read_text())["runs"]]
    model = fit(runs)
    m = model
    print(f"fit: gen = {m.a:.4f} + {m.b:.5f}·R/W s; update = {m.c:.4f} + {m.d:.5f}·R/W s; "
          f"sync = {m.e:.4f} + {m.f:.3g}·W·B s (B = {m.weight_bytes:.0f} bytes)")
    print(f"\nchecked against the measured points ({args.cores:g} cores shared by the busy workers):\n")
    print(check_table(runs, model, args.cores))
    rpw = args.rows_per_worker or max(r["rows"] / r["workers"] for r in runs)
    print(f"\nprojection, async K=1 (= one-step-off), each worker a core of its own, {rpw:g} rows per rollout worker:\n")
    print(projection_table(model, args.project, rpw))


if __name__ == "__main__":
    main()
