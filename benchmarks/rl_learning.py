"""RL learning benchmark: an RL recipe from the SFT checkpoint of the arithmetic task.

Target (issue 6): in 15 minutes on 2 CPU cores, GRPO and DAPO each raise exact-match
accuracy on 500 held-out problems by ≥ 10 points over the SFT checkpoint, PPO by ≥ 5.
The SFT checkpoint and the data are those of `benchmarks/sft_learning.py`:

    python benchmarks/sft_learning.py --out runs/bench_sft
    python benchmarks/rl_learning.py --recipe recipes/dapo.yaml --out runs/bench_dapo
    python benchmarks/rl_learning.py --recipe recipes/ppo.yaml --out runs/bench_ppo --command ppo

The step count comes from the recipe (or an override); `--minutes` sets
`trainer.max_time_s`: the run stops at the first step boundary past the budget
(counting training, evaluation and checkpointing), then evaluates. The base accuracy is measured here with the same
evaluation (greedy, the task's scorer, the same 500 problems). Writes
OUT/rl_learning.json (curve of step, seconds, eval/accuracy) and OUT/rl_learning.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from posttrain.config import GRPOConfig, PPOConfig, build_config
from posttrain.data.sources import load_rows
from posttrain.evaluation import evaluate_task
from posttrain.models.factory import build_model_and_tokenizer
from posttrain.trainers.rl import GRPOTrainer, PPOTrainer


def base_accuracy(cfg, rows) -> float:
    """Held-out accuracy of the starting policy, with the RL run's own evaluation."""
    model, tokenizer = build_model_and_tokenizer(cfg.model)
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    metrics, _ = evaluate_task(model.eval(), tokenizer, rows, cfg.eval.task, max_new, cfg.eval.batch_size)
    return metrics["accuracy"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/dapo.yaml")
    p.add_argument("--command", choices=["grpo", "ppo"], default="grpo")
    p.add_argument("--sft", default="runs/bench_sft/sft/final", help="the SFT checkpoint to start from")
    p.add_argument("--data", default="runs/bench_sft/data", help="folder with train.jsonl and test.jsonl")
    p.add_argument("--out", default="runs/bench_rl")
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget; 0 = run max_steps")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of the recipe")
    args = p.parse_intermixed_args()
    out, data = Path(args.out), Path(args.data)
    cls = PPOConfig if args.command == "ppo" else GRPOConfig
    cfg = build_config(cls, args.recipe, [
        f"model.path={args.sft}",
        f"data.train_files=[{data / 'train.jsonl'}]",
        f"data.eval_files=[{data / 'test.jsonl'}]",
        "eval.task=arithmetic",  # the recipes' task: named, since data.train_files drops it otherwise
        f"trainer.output_dir={out / 'rl'}",
        "trainer.resume=never",
        "trainer.overwrite=true",
        "eval.num_examples=500",
        *([f"trainer.max_time_s={args.minutes * 60}"] if args.minutes else []),
        *args.overrides,
    ])
    rows = list(load_rows(str(data / "test.jsonl")))[: cfg.eval.num_examples]
    base = base_accuracy(cfg, rows)
    print(f"base accuracy {base:.3f} on {len(rows)} held-out problems")

    trainer = (PPOTrainer if args.command == "ppo" else GRPOTrainer)(args=cfg)
    t0 = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - t0

    rows_m = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    elapsed, curve = 0.0, [{"step": 0, "seconds": 0.0, "accuracy": base}]
    for r in rows_m:
        elapsed += r.get("timing/step", 0.0) + r.get("timing/eval", 0.0)
        if "eval/accuracy" in r:
            curve.append({"step": r["step"], "seconds": round(elapsed, 1), "accuracy": r["eval/accuracy"]})
    final = result.metrics.get("eval/accuracy", curve[-1]["accuracy"])
    summary = {
        "recipe": args.recipe, "overrides": args.overrides, "wall_seconds": round(wall, 1),
        "steps": result.step, "base_accuracy": base, "final_accuracy": final,
        "gain_points": round(100 * (final - base), 1), "curve": curve,
    }
    (out / "rl_learning.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    plot(curve, out / "rl_learning.png", f"{Path(args.recipe).stem} from the SFT checkpoint")


def plot(curve: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([c["seconds"] / 60 for c in curve], [100 * c["accuracy"] for c in curve], marker="o")
    ax.set_xlabel("minutes")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
