"""Agent learning benchmark: SFT on the tool task, then GRPO over multi-turn episodes (issue 18).

The built-in `tiny` model from scratch on the bundled `arithmetic_tools` task (sums of 2-3
digit products, which it cannot multiply in its head; `posttrain.data.tasks.arithmetic_tools`):

1. data: the same problems twice (same seed): the tool demonstrations and a no-tool
   baseline whose demonstrations all answer from the head (`use_tools=false`). Every tool
   demonstration calls the calculator for the second product and for the products' sum;
   `--product-call-fraction` (0.3) of them call it for the first product too, the rest
   work that one out in the head (`23*47=1081`), which the tiny model cannot do. SFT
   teaches it to copy operands and results into calls (every demonstration does both) and
   leaves it seldom handing the first product to the tool: what RL has to learn is to reach
   for the tool there. (`--sum-call-fraction` leaves the choice at the sum instead, and
   `--tool-fraction` and `--hinted` at the whole problem; with them the tiny model learned
   to copy from the calculator's results on some seeds only, benchmarks/README.md.) The
   held-out problems and the RL prompts (rl.jsonl, in neither train nor test) are plain.
2. SFT of the tool data (`recipes/sft_tools.yaml`, `--sft-steps` of a `--sft-schedule-steps`
   cosine, 1000 of 1000 by default: trained to the end, where every seed has learned to
   copy). `--sft-stop-at` > 0 stops it by a measured criterion instead: from step
   `--sft-min-steps` on, every `--sft-check-every` steps (the run is resumed from its own
   checkpoint), greedy episodes of `--dev-n` dev problems (held back from rl.jsonl, in
   neither the held-out set nor the RL prompts); SFT stops at the first check whose dev
   accuracy reaches `--sft-stop-at`. The no-tool baseline trains as many steps as the tool
   SFT took.
3. eval of both SFT models: greedy episodes of the 500 held-out problems with the
   calculator environment (`arithmetic_tools`) under the RL recipe's turn and token limits,
   scored by the task (the last `Answer:` line).
4. GRPO over episodes from the tool SFT model (`recipes/grpo_tools.yaml`) on the RL
   prompts (less the dev problems), for `--rl-minutes` (the run stops at the first step
   past the budget).
5. eval of the RL model, as 3.
6. rollout speed of the RL model: the same sampled episodes (`--speed-prompts` prompts x
   the recipe's rollout.n, temperature 1, seeded) with the native engine, which extends
   each row's KV cache by the appended tokens, and the hf engine, which re-encodes the
   history after every environment answer; alternating, `--speed-reps` times each, in one
   process. Reports episodes/s and model tokens/s.

`--speed-only` measures step 6 alone, on the RL model of a finished run in `--out`.
`--threads` sets torch's threads (default one per core), to check the result at another
thread count.

Targets (issue 18): RL gains >= +10 points in <= 10 minutes on 2 CPU cores, and the tool
model beats the no-tool SFT baseline on the same held-out problems by >= +20 points.

    python benchmarks/agent_learning.py --out runs/bench_agent --seed 0

Writes OUT/agent_learning.json (every figure, the machine) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from posttrain.config import GRPOConfig, ModelConfig, SFTConfig, build_config
from posttrain.data.sources import load_rows
from posttrain.data.tasks import make_task
from posttrain.envs import play_episodes, resolve_environment
from posttrain.evaluation import evaluate_task
from posttrain.models.factory import build_model_and_tokenizer
from posttrain.rollout import MultiTurnLimits, SamplingParams, make_engine
from posttrain.trainers.rl import GRPOTrainer
from posttrain.trainers.sft import SFTTrainer

TASK, ENV = "arithmetic_tools", "arithmetic_tools"
SFT_RECIPE, RL_RECIPE = "recipes/sft_tools.yaml", "recipes/grpo_tools.yaml"
MIN_GAIN, MIN_TOOL_ADVANTAGE, MAX_RL_SECONDS = 10.0, 20.0, 600.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_agent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hinted", type=float, default=0.0, help="share of SFT prompts that ask for the tool")
    p.add_argument("--tool-fraction", type=float, default=1.0,
                   help="share of the plain SFT prompts whose demonstration calls the tool")
    p.add_argument("--sum-call-fraction", type=float, default=1.0,
                   help="share of the tool demonstrations that call the calculator for the sum too")
    p.add_argument("--product-call-fraction", type=float, default=0.3,
                   help="share of the tool demonstrations that call it for the first product (the rest work it out in the head)")
    p.add_argument("--sft-steps", type=int, default=1000, help="the most SFT steps")
    p.add_argument("--sft-schedule-steps", type=int, default=1000,
                   help="the SFT cosine's length (trainer.lr_schedule_steps, >= --sft-steps)")
    p.add_argument("--sft-stop-at", type=float, default=0.0,
                   help="stop SFT at the first check whose greedy dev accuracy reaches this (0: train --sft-steps)")
    p.add_argument("--sft-min-steps", type=int, default=300, help="the first check's step")
    p.add_argument("--sft-check-every", type=int, default=20, help="steps between checks")
    p.add_argument("--dev-n", type=int, default=100, help="dev problems, held back from rl.jsonl")
    p.add_argument("--rl-minutes", type=float, default=8.0, help="GRPO's wall-clock budget")
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--speed-prompts", type=int, default=32)
    p.add_argument("--speed-reps", type=int, default=2, help="0: no rollout speed test")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    p.add_argument("--skip-baseline", action="store_true", help="no no-tool SFT (exploration only)")
    p.add_argument("--speed-only", action="store_true",
                   help="only the rollout speed (step 6) of OUT's finished run: OUT/rl/final on OUT/data")
    p.add_argument("rl_overrides", nargs="*", help="extra key=value overrides of the GRPO recipe")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.speed_only:
        return print_speed(out, args)
    seconds: dict[str, float] = {}
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}

    t = time.perf_counter()
    data = out / "data"
    make_task(TASK, data, n_train=8000, n_test=args.n_test, n_rl=2000, seed=args.seed,
              tool_fraction=args.tool_fraction, hinted=args.hinted, sum_call_fraction=args.sum_call_fraction,
              product_call_fraction=args.product_call_fraction)
    if not args.skip_baseline:
        make_task(TASK, out / "data_notool", n_train=8000, n_test=args.n_test, n_rl=2000, seed=args.seed, use_tools=False)
    seconds["data"] = time.perf_counter() - t

    dev_rows = split_dev(data, args.dev_n)
    rl_cfg = rl_config(out, data, out / "sft" / "final", args)
    limits = MultiTurnLimits.from_config(rl_cfg.rollout.multi_turn)
    test_rows = load_rows(str(data / "test.jsonl"))

    def accuracy(model_dir: Path, rows: list[dict]) -> tuple[dict[str, float], list[dict]]:
        model, tokenizer = build_model_and_tokenizer(ModelConfig(path=str(model_dir), device="cpu", dtype="float32"))
        return evaluate_task(model.eval(), tokenizer, rows, TASK, rl_cfg.rollout.max_new_tokens, 64,
                             environment=resolve_environment(ENV), limits=limits)

    def eval_episodes(model_dir: Path, name: str) -> dict[str, float]:
        t = time.perf_counter()
        metrics, samples = accuracy(model_dir, test_rows)
        (out / f"samples_{name}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        seconds[f"eval_{name}"] = time.perf_counter() - t
        print(f"[{name}] held-out accuracy {100 * metrics['accuracy']:.1f}%, "
              f"tool calls/episode {metrics.get('tool_calls/mean', 0):.2f}", flush=True)
        return metrics

    t = time.perf_counter()
    sft_model, results["sft_stop"] = train_sft_until(out / "sft", data, args,
                                                     lambda d: accuracy(d, dev_rows)[0]["accuracy"])
    seconds["sft"] = time.perf_counter() - t
    results["sft"] = eval_episodes(sft_model, "sft")
    if not args.skip_baseline:
        t = time.perf_counter()
        base_model = train_sft(out / "sft_notool", out / "data_notool", args, results["sft_stop"]["step"])
        seconds["sft_notool"] = time.perf_counter() - t
        results["sft_notool"] = eval_episodes(base_model, "sft_notool")

    t = time.perf_counter()
    rl_model = GRPOTrainer(args=rl_cfg).train().final_dir
    seconds["rl"] = time.perf_counter() - t
    results["rl"] = eval_episodes(rl_model, "rl")
    results["rl_curve"] = rl_curve(out / "rl" / "metrics.jsonl")
    if args.speed_reps:
        results["speed"] = rollout_speed(rl_model, load_rows(str(data / "rl.jsonl"))[: args.speed_prompts],
                                         rl_cfg, limits, args.speed_reps)
    results["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    results["verdict"] = verdict(results)
    (out / "agent_learning.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + format_results(results), flush=True)
    return 0 if results["verdict"]["pass"] else 1


def print_speed(out: Path, args: argparse.Namespace) -> int:
    """`--speed-only`: the rollout speed of the RL model of the finished run in `out`."""
    model, data = out / "rl" / "final", out / "data"
    if not (model / "config.json").is_file() or not (data / "rl.jsonl").is_file():
        print(f"--speed-only: {model} or {data / 'rl.jsonl'} is missing; run the benchmark with --out {out} first")
        return 2
    cfg = rl_config(out, data, model, args)
    rows = load_rows(str(data / "rl.jsonl"))[: args.speed_prompts]
    speed = rollout_speed(model, rows, cfg, MultiTurnLimits.from_config(cfg.rollout.multi_turn), max(1, args.speed_reps))
    print(json.dumps(speed, indent=2) + "\n\n" + "\n".join(speed_lines(speed)), flush=True)
    return 0


def split_dev(data: Path, n: int) -> list[dict]:
    """The last `n` rows of rl.jsonl, held back as SFT's dev set; the rest, rl_train.jsonl, are RL's prompts."""
    rows = load_rows(str(data / "rl.jsonl"))
    if not 0 < n < len(rows):
        raise SystemExit(f"--dev-n must be in (0, {len(rows)}), got {n}")
    (data / "rl_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-n]))
    return rows[-n:]


def check_steps(first: int, every: int, last: int) -> list[int]:
    """The steps at which SFT's dev accuracy is checked: first, first + every, ..., last."""
    first = min(first, last)
    return [*range(first, last, every), last]


def train_sft_until(run_dir: Path, data: Path, args: argparse.Namespace,
                    dev_accuracy: Any) -> tuple[Path, dict[str, Any]]:
    """SFT resumed from its own checkpoint from check to check (`check_steps`) until
    `dev_accuracy(final_dir)` reaches `--sft-stop-at` (or `--sft-steps`). Returns the model and
    {"step": the step it stopped at, "checks": [{"step", "dev_accuracy"}, ...]}."""
    if args.sft_stop_at <= 0:
        return train_sft(run_dir, data, args, args.sft_steps), {"step": args.sft_steps, "checks": []}
    checks: list[dict[str, float]] = []
    for i, step in enumerate(check_steps(args.sft_min_steps, args.sft_check_every, args.sft_steps)):
        final = train_sft(run_dir, data, args, step, resume=i > 0)
        checks.append({"step": step, "dev_accuracy": dev_accuracy(final)})
        print(f"[sft] step {step}: dev accuracy {100 * checks[-1]['dev_accuracy']:.0f}%", flush=True)
        if checks[-1]["dev_accuracy"] >= args.sft_stop_at:
            break
    return final, {"step": checks[-1]["step"], "checks": checks}


def train_sft(run_dir: Path, data: Path, args: argparse.Namespace, steps: int, resume: bool = False) -> Path:
    """`steps` SFT steps of the `--sft-schedule-steps` cosine; `resume`: continue the run in
    `run_dir` from its last checkpoint (the last step always saves one)."""
    cfg = build_config(SFTConfig, SFT_RECIPE, [
        f"data.train_files=[{data / 'train.jsonl'}]", "data.eval_files=[]",
        f"trainer.output_dir={run_dir}", f"trainer.max_steps={steps}", f"trainer.seed={args.seed}",
        f"trainer.lr_schedule_steps={max(args.sft_schedule_steps, steps)}",
        "trainer.eval_steps=0", "trainer.save_steps=0", "trainer.report_to=[]",
        *(["trainer.resume=auto"] if resume else ["trainer.resume=never", "trainer.overwrite=true"]),
    ])
    return SFTTrainer(args=cfg).train().final_dir


def rl_config(out: Path, data: Path, sft_model: Path, args: argparse.Namespace) -> GRPOConfig:
    return build_config(GRPOConfig, RL_RECIPE, [
        f"model.path={sft_model}", f"data.train_files=[{data / 'rl_train.jsonl'}]",
        f"data.eval_files=[{data / 'test.jsonl'}]", "eval.task=arithmetic_tools", f"trainer.output_dir={out / 'rl'}",
        f"trainer.seed={args.seed}", f"trainer.max_time_s={args.rl_minutes * 60}", "trainer.max_steps=100000",
        "trainer.save_steps=0", "trainer.eval_steps=50", "eval.num_examples=100",
        "trainer.resume=never", "trainer.overwrite=true", "trainer.report_to=[]", *args.rl_overrides,
    ])


def rl_curve(metrics_file: Path) -> list[dict[str, float]]:
    """(step, eval/accuracy) of the RL run's own evaluations (100 problems)."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return [{"step": r["step"], "accuracy": r["eval/accuracy"]} for r in rows if "eval/accuracy" in r]


def rollout_speed(model_dir: Path, rows: list[dict], cfg: GRPOConfig, limits: MultiTurnLimits, reps: int) -> dict:
    """Episodes/s and model tokens/s of the native (KV-cache extension, over the built-in
    model) and hf (re-encoding, over the same weights loaded by transformers) engines on the
    same seeded episodes, alternating in one process."""
    engines = {}
    for kind, impl in (("native", "builtin"), ("hf", "hf")):
        model, tokenizer = build_model_and_tokenizer(
            ModelConfig(path=str(model_dir), device="cpu", dtype="float32", impl=impl))
        engines[kind] = make_engine(kind, model.eval(), tokenizer)
    params = SamplingParams(n=cfg.rollout.n, temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens, seed=0)
    env = resolve_environment(ENV)
    times: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, int] = {}
    with torch.inference_mode():
        for _ in range(reps):
            for name, engine in engines.items():
                t = time.perf_counter()
                episodes, _, _ = play_episodes(engine, [dict(r) for r in rows], env, params, limits)
                times[name].append(time.perf_counter() - t)
                tokens[name] = int(episodes.response_mask.sum())
    n_episodes = len(rows) * cfg.rollout.n
    speed = {name: {"seconds": round(min(ts), 2), "episodes_per_s": round(n_episodes / min(ts), 1),
                    "model_tokens_per_s": round(tokens[name] / min(ts), 0), "model_tokens": tokens[name]}
             for name, ts in times.items()}
    speed["episodes"] = n_episodes
    speed["native_over_hf"] = round(times["hf"] and min(times["hf"]) / min(times["native"]), 2)
    return speed


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    gain = 100 * (r["rl"]["accuracy"] - r["sft"]["accuracy"])
    v = {"gain_points": round(gain, 1), "rl_seconds": r["seconds"]["rl"]}
    ok = gain >= MIN_GAIN and r["seconds"]["rl"] <= MAX_RL_SECONDS
    if "sft_notool" in r:
        best_tool = max(r["rl"]["accuracy"], r["sft"]["accuracy"])
        v["tool_advantage_points"] = round(100 * (best_tool - r["sft_notool"]["accuracy"]), 1)
        v["sft_tool_advantage_points"] = round(100 * (r["sft"]["accuracy"] - r["sft_notool"]["accuracy"]), 1)
        ok = ok and v["tool_advantage_points"] >= MIN_TOOL_ADVANTAGE
    v["pass"] = ok
    return v


def format_results(r: dict[str, Any]) -> str:
    m, v, s = r["machine"], r["verdict"], r["seconds"]
    lines = [f"Machine: {m['cpu_model']} ({'AVX-512' if m['avx512f'] else 'no AVX-512'}), {m['cores']} cores, "
             f"torch {m['torch']}, {torch.get_num_threads()} threads, {m['date']}", "",
             "| model | held-out accuracy | tool calls / episode | turns / episode | seconds to train |",
             "|---|---|---|---|---|"]
    for key, label, secs in (("sft_notool", "SFT, no-tool demonstrations", s.get("sft_notool")),
                             ("sft", "SFT, tool demonstrations", s["sft"]), ("rl", "GRPO over episodes", s["rl"])):
        if key in r:
            e = r[key]
            lines.append(f"| {label} | {100 * e['accuracy']:.1f}% | {e.get('tool_calls/mean', 0):.2f} | "
                         f"{e.get('turns/mean', 0):.2f} | {secs:.0f} |")
    stop = r.get("sft_stop")
    if stop and stop["checks"]:
        lines += ["", f"Tool SFT stopped at step {stop['step']}; dev accuracy at the checks: "
                  + ", ".join(f"{c['step']}: {100 * c['dev_accuracy']:.0f}%" for c in stop["checks"]) + "."]
    lines += ["", f"RL gain: {v['gain_points']:+.1f} points in {v['rl_seconds']:.0f} s "
                  f"(target >= +{MIN_GAIN:.0f} in <= {MAX_RL_SECONDS:.0f} s)."]
    if "tool_advantage_points" in v:
        lines.append(f"Tool model over the no-tool baseline: {v['tool_advantage_points']:+.1f} points "
                     f"(SFT alone {v['sft_tool_advantage_points']:+.1f}; target >= +{MIN_TOOL_ADVANTAGE:.0f}).")
    sp = r.get("speed")
    if sp:
        lines += speed_lines(sp)
    lines += ["", "RL curve (100 problems): " + ", ".join(f"{c['step']}: {100 * c['accuracy']:.0f}%" for c in r["rl_curve"]),
              "", f"**{'PASS' if v['pass'] else 'FAIL'}**"]
    return "\n".join(lines)


def speed_lines(sp: dict[str, Any]) -> list[str]:
    lines = ["", f"Rollout of {sp['episodes']} episodes (temperature 1):", "",
              "| engine | history after an answer | seconds | episodes/s | model tokens/s |", "|---|---|---|---|---|"]
    for name, how in (("native", "KV cache extended by the new tokens"), ("hf", "re-encoded")):
        e = sp[name]
        lines.append(f"| {name} | {how} | {e['seconds']} | {e['episodes_per_s']} | {e['model_tokens_per_s']:.0f} |")
    return [*lines, "", f"native / hf speed: {sp['native_over_hf']}x"]


def machine_info() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    return {"cpu_model": fields.get("Model name", "unknown"), "avx512f": "avx512f" in fields.get("Flags", "").split(),
            "cores": len(__import__("os").sched_getaffinity(0)), "torch": version("torch"),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


if __name__ == "__main__":
    sys.exit(main())
