"""Reward-model and DPO benchmarks on the bundled arithmetic task (built-in tiny model, CPU).

Stages, run in the order given by --stages (a stage whose output exists is skipped, except rm
and dpo, which always train):
  data    `make_task` (SFT rows) and constructed preference pairs (`make_preferences`); both use
          seed 0 and 500 test rows, so the pairs' held-out prompts are the SFT test problems
  sft     recipes/sft_arithmetic.yaml on the SFT rows (or --sft PATH: an existing checkpoint)
  sample  on-policy pairs: 8 samples per prompt from the SFT checkpoint at temperature 1
          (`sample_preferences`), --sampled-pairs of them
  rm      recipes/rm_arithmetic.yaml from the SFT checkpoint on the constructed pairs; target
          >= 90% pairwise accuracy on the 500 held-out pairs, measured through
          `posttrain.rewards.reward_model` (what `posttrain ppo reward.model_path=...` loads);
          also on the held-out sampled pairs when the sample stage ran (the SFT model's own
          mistakes); `--rm "data.train_files=[...]"` trains on other or more files
  judge   the SFT model's own preference on the same held-out pairs, log π(chosen) > log π(rejected)
          (summed response log-probs, as DPO reads them): what the backbone already knows
  dpo     recipes/dpo_arithmetic.yaml from the SFT checkpoint on --dpo-pairs; held-out task
          accuracy (500 problems, greedy, `posttrain.evaluation.evaluate_task`) before and after
  seen    the same accuracy on the first 500 DPO *training* prompts, before and after (does DPO
          fit its pairs without generalising?)

    python benchmarks/preference.py --out runs/bench_pref [--task-options key=value ...] \\
        [--stages data,sft,sample,rm,dpo] [--n-pairs 32000] [--pairs-per-prompt 4] [--bare-fraction 0] [--sampled-pairs 2000] [--dpo-pairs sampled] \\
        [--rm key=value ...] [--dpo key=value ...] [--sft-overrides key=value ...]

Writes OUT/preference.json: settings, accuracies and wall seconds per stage.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from posttrain.config import DPOConfig, ModelConfig, RMConfig, SFTConfig, build_config
from posttrain.config.core import parse_override
from posttrain.data.make_preferences import make_preferences
from posttrain.data.sources import load_rows
from posttrain.data.tasks import make_task
from posttrain.sample_preferences import sample_preferences

N_TEST = 500
QUIET = ["trainer.progress=false", "trainer.report_to=[]", "trainer.resume=never", "trainer.overwrite=true"]


def stage_data(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    if not (out / "data" / "sft" / "train.jsonl").exists():
        make_task("arithmetic", out / "data" / "sft", n_train=a.n_sft, n_test=N_TEST, seed=0, **a.task_options)
    if not (out / "data" / "pref" / "train.jsonl").exists():
        make_preferences("arithmetic", out / "data" / "pref", n_train=a.n_pairs, n_test=N_TEST, seed=0,
                         pairs_per_prompt=a.pairs_per_prompt, bare_fraction=a.bare_fraction, **a.task_options)
    return {}


def stage_sft(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    from posttrain.trainers.sft import run_sft

    if a.sft or (out / "sft" / "final").exists():
        return {}
    cfg = build_config(SFTConfig, "recipes/sft_arithmetic.yaml", [
        f"data.train_files=[{out / 'data' / 'sft' / 'train.jsonl'}]",
        f"data.eval_files=[{out / 'data' / 'sft' / 'test.jsonl'}]", "eval.task=arithmetic",
        f"trainer.output_dir={out / 'sft'}", *QUIET, *a.sft_overrides,
    ])
    return {"sft_eval_accuracy": run_sft(cfg).metrics.get("eval/accuracy")}


def stage_sample(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    if (out / "data" / "sampled" / "train.jsonl").exists():
        return {}
    info = sample_preferences("arithmetic", out / "data" / "sampled", str(a.sft_path), n_train=a.sampled_pairs,
                              n_test=N_TEST, seed=0, samples=8, max_new_tokens=48, **a.task_options)
    return {"sampled_prompt_counts": info["counts"], "sampled_pairs": [info["n_train"], info["n_test"]]}


def stage_rm(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    from posttrain.rewards.reward_model import reward_model
    from posttrain.trainers.reward import run_rm

    pairs = out / "data" / "pref"
    cfg = build_config(RMConfig, "recipes/rm_arithmetic.yaml", [
        f"model.path={a.sft_path}", f"data.train_files=[{pairs / 'train.jsonl'}]",
        f"data.eval_files=[{pairs / 'test.jsonl'}]", f"trainer.output_dir={out / 'rm'}", *QUIET, *a.rm,
    ])
    result = run_rm(cfg)
    scorer = reward_model(result.final_dir, device="cpu", dtype="float32")

    def ranked_right(rows: list[dict]) -> list[bool]:
        prompts = [r["prompt"] for r in rows]
        return [c > w for c, w in zip(scorer(prompts, [r["chosen"] for r in rows]),
                                      scorer(prompts, [r["rejected"] for r in rows]))]

    rows = load_rows(pairs / "test.jsonl")
    right = ranked_right(rows)
    sampled = out / "data" / "sampled" / "test.jsonl"  # the SFT model's own right and wrong answers
    sampled_right = ranked_right(load_rows(sampled)) if sampled.exists() else []

    def accuracy_by(column: str) -> dict[str, float]:
        groups: dict[str, list[bool]] = {}
        for row, ok in zip(rows, right):
            if column in row:
                groups.setdefault(row[column], []).append(ok)
        return {k: round(sum(v) / len(v), 3) for k, v in sorted(groups.items())}

    return {
        "rm_eval_accuracy": result.metrics.get("eval/accuracy"),
        "rm_pairwise_accuracy_via_reward_model": sum(right) / len(rows),
        "rm_accuracy_by_error": accuracy_by("error"),
        **({"rm_accuracy_by_form": accuracy_by("form")} if "form" in rows[0] else {}),
        **({"rm_pairwise_accuracy_sampled_pairs": sum(sampled_right) / len(sampled_right)} if sampled_right else {}),
        "rm_steps": cfg.trainer.max_steps,
    }


def stage_judge(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from posttrain.data.preference import pair_collate, prepare_pairs
    from posttrain.models.factory import build_model_and_tokenizer
    from posttrain.trainers.dpo import sequence_logps

    model, tok = build_model_and_tokenizer(ModelConfig(path=str(a.sft_path)))
    _, examples, _ = prepare_pairs(out / "data" / "pref" / "test.jsonl", tok, DPOConfig().data)
    right = []
    with torch.no_grad():
        for i in range(0, len(examples), 100):
            chosen, rejected = sequence_logps(model.eval(), pair_collate(examples[i : i + 100], tok.pad_token_id))[0].chunk(2)
            right += (chosen > rejected).tolist()
    return {"sft_logp_pairwise_accuracy": sum(right) / len(right)}


def task_accuracy(model_dir: Path, rows: Any) -> float:
    from posttrain.evaluation import evaluate_task
    from posttrain.models.factory import build_model_and_tokenizer

    model, tok = build_model_and_tokenizer(ModelConfig(path=str(model_dir)))
    return evaluate_task(model.eval(), tok, rows, "arithmetic", max_new_tokens=48, batch_size=64)[0]["accuracy"]


def stage_dpo(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    from posttrain.trainers.dpo import run_dpo

    test_rows = load_rows(out / "data" / "sft" / "test.jsonl")
    pairs = out / "data" / a.dpo_pairs
    cfg = build_config(DPOConfig, "recipes/dpo_arithmetic.yaml", [
        f"model.path={a.sft_path}", f"data.train_files=[{pairs / 'train.jsonl'}]",
        f"data.eval_files=[{pairs / 'test.jsonl'}]", f"trainer.output_dir={out / 'dpo'}", "eval.task=null",
        *QUIET, *a.dpo,
    ])
    before = task_accuracy(a.sft_path, test_rows)
    result = run_dpo(cfg)
    return {
        "task_accuracy_before_dpo": before,
        "task_accuracy_after_dpo": task_accuracy(result.final_dir, test_rows),
        "dpo_eval_rewards_accuracies": result.metrics.get("eval/rewards/accuracies"),
        "dpo_pairs": a.dpo_pairs,
        "dpo_steps": cfg.trainer.max_steps,
        "dpo_loss_type": cfg.algorithm.loss_type,
        "dpo_rpo_alpha": cfg.algorithm.rpo_alpha,
    }


def stage_seen(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    rows = load_rows(out / "data" / a.dpo_pairs / "train.jsonl")[:N_TEST]
    return {"seen_accuracy_before_dpo": task_accuracy(a.sft_path, rows),
            "seen_accuracy_after_dpo": task_accuracy(out / "dpo" / "final", rows)}


STAGES = {"data": stage_data, "sft": stage_sft, "sample": stage_sample, "rm": stage_rm, "judge": stage_judge,
          "dpo": stage_dpo, "seen": stage_seen}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_pref")
    p.add_argument("--stages", default="data,sft,rm,dpo")
    p.add_argument("--task-options", nargs="*", default=[], metavar="key=value",
                   help="arithmetic task options (default: the medium preset, 1-digit operands)")
    p.add_argument("--sft", default=None, help="an existing SFT checkpoint (the sft stage is then skipped)")
    p.add_argument("--n-sft", type=int, default=8000, help="SFT rows")
    p.add_argument("--n-pairs", type=int, default=32000, help="constructed training pairs")
    p.add_argument("--pairs-per-prompt", type=int, default=4,
                   help="constructed training pairs per prompt, each with a different mistake")
    p.add_argument("--bare-fraction", type=float, default=0.0,
                   help="constructed pairs: each side written without its steps with this probability")
    p.add_argument("--sampled-pairs", type=int, default=2000, help="sampled training pairs (sample stage)")
    p.add_argument("--dpo-pairs", default="pref", choices=["pref", "sampled"],
                   help="DPO training pairs: constructed (pref) or sampled from the SFT model")
    p.add_argument("--sft-overrides", nargs="*", default=[], metavar="key=value")
    p.add_argument("--rm", nargs="*", default=[], metavar="key=value", help="overrides of recipes/rm_arithmetic.yaml")
    p.add_argument("--dpo", nargs="*", default=[], metavar="key=value", help="overrides of recipes/dpo_arithmetic.yaml")
    a = p.parse_args()
    a.task_options = dict(parse_override(o) for o in a.task_options)
    out = Path(a.out)
    a.sft_path = Path(a.sft) if a.sft else out / "sft" / "final"
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "preference.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for name in a.stages.split(","):
        t0 = time.perf_counter()
        summary.update(STAGES[name](out, a))
        summary[f"wall_seconds/{name}"] = round(time.perf_counter() - t0, 1)
        summary[f"settings/{name}"] = {k: v for k, v in vars(a).items() if k not in ("stages",)} | {"sft_path": str(a.sft_path)}
        summary_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
