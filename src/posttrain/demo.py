"""`posttrain demo`: the whole pipeline on a laptop CPU, with nothing downloaded.

    data (arithmetic) → SFT of the built-in tiny model from scratch → eval → RL → eval
      → before/after table → report

`run_demo(out)` writes, under OUT:

    data/{train,rl,test}.jsonl, task.json the bundled arithmetic task (`make_task`): SFT
                                          demonstrations, RL prompts, held-out problems
    sft/                                  the SFT run directory (config.yaml, metrics.jsonl, final/, ...)
    eval_sft/{eval.json,samples.jsonl}    the SFT model on the held-out problems
    rl/                                   the RL run directory; rl/final/ is the demo's model
    eval_rl/{eval.json,samples.jsonl}     the RL model on the same problems
    report.html, report-*.png             `posttrain report` of the SFT and RL runs together
    summary.json                          sft_accuracy, rl_accuracy, gain, wall_seconds, ...

Both evaluations are greedy, on the same held-out problems, with the RL reward functions
and the RL run's token budget, so the two rows of the table differ only by the RL stage.

The configs are the recipes shipped in the package, `sft_arithmetic` and `grpo`
(`posttrain.config.core.RECIPES`, the repository's `recipes/`), with the demo's paths,
step counts and evaluation sizes as overrides. `--quick` runs the same stages at a size that
only proves they work (the test suite runs it); its numbers mean nothing.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config import GRPOConfig, ModelConfig, SFTConfig, build_config
from posttrain.logging import Progress

TASK = "arithmetic"
# Half the SFT demonstrations are asked for their steps ("Show work: 3+4*2-1=") and show
# them; the other half are plain prompts, worked in 15% of them. The held-out problems and
# the RL prompts are plain. The SFT model can work step by step, but answers most plain
# prompts from its head: RL learns that working pays on every prompt. Without the hint
# (worked 0.3 on every prompt) RL gained only once SFT had run long enough to make the
# steps reliable (~400 s at one thread on the Xeon); with it, 650 steps suffice
# (benchmarks/README.md, "Demo robustness").
TASK_OPTIONS = {"worked": 0.15, "hinted": 0.5}
SEED = 0

# SFT of the built-in model from scratch: the shipped recipes/sft_arithmetic.yaml (benchmarks/
# README.md, "SFT learning"). The run's own eval (see FULL) is smaller than the recipe's: the
# demo evaluates the final model on every held-out problem itself.
SFT_RECIPE = "sft_arithmetic"
SFT_STEPS = 650
QUICK_SFT_STEPS = 40

# RL from the SFT model: the shipped recipes/grpo.yaml (group-normalised advantages, clip
# 0.2, seq-mean-token-mean, k3 KL in the loss with β = 0.04, lr 5e-5). Its reward.functions
# also score both evaluations (a sample is correct when its total is >= 1). RL learns within
# 25-50 steps that showing the steps pays, then holds (benchmarks/README.md, "Demo
# robustness"). The stage runs 100 steps or 120 s, whichever ends first (one torch thread on
# a 2-core Xeon makes ~90 steps in 120 s): the run stops at the first step past the budget,
# then evaluates. The budget keeps the demo within 10 minutes on slower CPUs.
RL_RECIPE = "grpo"
RL_STEPS = 100
RL_MAX_SECONDS = 120
QUICK_RL_STEPS = 3
# --quick: 4 prompts x 4 samples of at most 32 tokens per step.
QUICK_RL_OVERRIDES = [
    "data.train_batch_size=4",
    "rollout.n=4",
    "rollout.max_new_tokens=32",
    "actor.micro_batch_size=16",
]
# The recipes' checkpoint cadence is for long runs; the demo keeps final/ only.
NO_CHECKPOINTS = ["trainer.save_steps=0"]


@dataclass(frozen=True)
class DemoSize:
    """How big each stage is: the full demo or `--quick`."""

    n_train: int  # SFT demonstrations
    n_rl: int  # RL prompts, none of them in train or test
    n_test: int  # held-out problems, all evaluated before and after RL
    sft_steps: int
    sft_extra: tuple[str, ...]  # overrides of the SFT recipe (e.g. the run's own eval)
    rl_steps: int
    rl_extra: tuple[str, ...]  # overrides of the RL recipe


FULL = DemoSize(
    n_train=8000, n_rl=2000, n_test=500,
    sft_steps=SFT_STEPS, sft_extra=("trainer.eval_steps=130", "eval.num_examples=200"),
    rl_steps=RL_STEPS, rl_extra=("trainer.eval_steps=25", "eval.num_examples=100", f"trainer.max_time_s={RL_MAX_SECONDS}"),
)
QUICK = DemoSize(
    n_train=500, n_rl=100, n_test=50,
    sft_steps=QUICK_SFT_STEPS, sft_extra=("trainer.warmup_steps=5", "trainer.eval_steps=0", "eval.num_examples=10"),
    rl_steps=QUICK_RL_STEPS, rl_extra=(*QUICK_RL_OVERRIDES, "trainer.eval_steps=0", "eval.num_examples=10"),
)

# What the demo writes directly under OUT; a rerun replaces exactly these.
OUTPUTS = ("data", "sft", "eval_sft", "rl", "eval_rl", "summary.json", "report.html", "report.html.tmp")
STAGES = 7


def run_demo(
    out: str | Path = "runs/demo", quick: bool = False, device: str | None = None, seed: int = SEED,
) -> dict[str, Any]:
    """Run every stage into `out` (see the module docstring); returns what summary.json holds.

    `device`: "auto" or None (CUDA when available), "cpu", "cuda", "cuda:N".
    `seed`: the task's data (which problems are drawn) and both trainers' `trainer.seed`
    (initialisation, shuffling, sampling); the evaluations are greedy.
    Raises ValueError when `out` holds files the demo did not write.
    """
    out, size, device = Path(out), QUICK if quick else FULL, device or "auto"
    data = {split: out / "data" / f"{split}.jsonl" for split in ("train", "rl", "test")}
    shared = [f"model.device={device}", "model.dtype=float32", "trainer.resume=never", "trainer.report_to=[]",
              f"trainer.seed={seed}"]
    # Both configs first, so that a bad override fails before anything is trained.
    sft_cfg = sft_config(data, out / "sft", size, shared)
    rl_cfg = rl_config(data, out / "sft" / "final", out / "rl", size, shared)
    clear_previous(out)
    started, seconds = time.perf_counter(), {}

    stage(1, f"data: {size.n_train} SFT demonstrations, {size.n_rl} RL prompts and {size.n_test} held-out "
             "arithmetic problems", out / "data")
    with timed(seconds, "data"):
        with Progress(1, "data") as bar:  # seconds; a bar so every stage reports the same way
            make_data(out / "data", size, seed)
            bar.update(1)

    stage(2, f"SFT: the built-in tiny model from scratch, {size.sft_steps} steps", out / "sft")
    with timed(seconds, "sft"):
        sft_model = train_sft(sft_cfg)

    stage(3, f"eval: the SFT model on {size.n_test} held-out problems (greedy)", out / "eval_sft")
    with timed(seconds, "eval_sft"):
        before = evaluate_model(sft_model, data["test"], rl_cfg, out / "eval_sft", device)

    stage(4, f"RL from the SFT model: {size.rl_steps} steps of "
             f"{rl_cfg.data.train_batch_size} prompts x {rl_cfg.rollout.n} samples", out / "rl")
    with timed(seconds, "rl"):
        rl_model = train_rl(rl_cfg)

    stage(5, "eval: the RL model on the same problems", out / "eval_rl")
    with timed(seconds, "eval_rl"):
        after = evaluate_model(rl_model, data["test"], rl_cfg, out / "eval_rl", device)

    stage(6, "before / after RL", None)
    print(comparison_table(before, after), flush=True)

    stage(7, "report: the SFT and RL runs on one page", out / "report.html")
    with timed(seconds, "report"):
        with Progress(1, "report") as bar:
            report = write_demo_report(out)
            bar.update(1)

    summary = make_summary(before, after, seconds, time.perf_counter() - started, size, quick, device, seed, {
        "data": out / "data", "sft_run": out / "sft", "rl_run": out / "rl", "model": rl_model,
        "eval_sft": out / "eval_sft" / "eval.json", "eval_rl": out / "eval_rl" / "eval.json", "report": report,
    })
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"\ndemo finished in {summary['wall_seconds']:.0f} s; summary: {out / 'summary.json'}")
    print(f"model:  {rl_model}\nreport: {report}", flush=True)
    return summary


# ---------------------------------------------------------------------------- stages


def make_data(out: Path, size: DemoSize, seed: int = SEED) -> None:
    """train.jsonl, rl.jsonl, test.jsonl and task.json of the bundled arithmetic task (the
    same bytes for the same size and seed)."""
    from posttrain.data.tasks import make_task

    make_task(TASK, out, n_train=size.n_train, n_test=size.n_test, n_rl=size.n_rl, seed=seed, **TASK_OPTIONS)


def sft_config(data: dict[str, Path], run_dir: Path, size: DemoSize, shared: Sequence[str]) -> SFTConfig:
    return build_config(SFTConfig, SFT_RECIPE, [
        *NO_CHECKPOINTS, *shared, *size.sft_extra,
        f"trainer.max_steps={size.sft_steps}",
        *_paths(data["train"], data["test"], run_dir),
    ])


def rl_config(data: dict[str, Path], model: Path, run_dir: Path, size: DemoSize, shared: Sequence[str]) -> GRPOConfig:
    return build_config(GRPOConfig, RL_RECIPE, [
        *NO_CHECKPOINTS, *shared, *size.rl_extra,
        f"trainer.max_steps={size.rl_steps}",
        f"model.path={json.dumps(str(model))}",
        *_paths(data["rl"], data["test"], run_dir),
    ])


def train_sft(cfg: SFTConfig) -> Path:
    from posttrain.trainers.sft import SFTTrainer

    return SFTTrainer(args=cfg).train().final_dir


def train_rl(cfg: GRPOConfig) -> Path:
    from posttrain.trainers.rl import GRPOTrainer

    return GRPOTrainer(args=cfg).train().final_dir


def evaluate_model(model_dir: Path, test_file: Path, rl_cfg: GRPOConfig, out: Path, device: str) -> dict[str, float]:
    """Greedy completions of every held-out problem, scored by the RL reward functions
    (no length shaping even when the RL recipe has some); writes eval.json and
    samples.jsonl into `out` and returns the metrics (see `posttrain.evaluation`)."""
    from posttrain.data.sources import load_rows
    from posttrain.evaluation import evaluate
    from posttrain.models.factory import build_model_and_tokenizer
    from posttrain.rewards import RewardRunner

    model, tokenizer = build_model_and_tokenizer(ModelConfig(path=str(model_dir), device=device, dtype="float32"))
    model.eval()
    r = rl_cfg.reward
    runner = RewardRunner.from_specs(r.functions, weights=r.weights, timeout_s=60.0)
    report = evaluate(model, tokenizer, load_rows(str(test_file)), runner, n=1, temperature=0.0,
                      max_new_tokens=rl_cfg.rollout.max_new_tokens, batch_size=64, seed=SEED, progress=True)
    report.settings.update({"model": str(model_dir), "data": str(test_file)})
    report.write(out)
    return report.metrics


def write_demo_report(out: Path) -> Path:
    """report.html: the SFT and RL runs as the two stages of one pipeline, opening with the
    before/after table of their held-out evaluations."""
    from posttrain.report import write_report

    return write_report([out / "sft", out / "rl"], out, evals=[out / "eval_sft", out / "eval_rl"]).html


# ---------------------------------------------------------------------------- output


TABLE_ROWS = (  # (label, metric, scale, format of a value, format of the change)
    ("accuracy", "accuracy", 100, "{:.1f}%", "{:+.1f} pts"),
    ("mean length (tokens)", "response_length/mean", 1, "{:.1f}", "{:+.1f}"),
    ("mean reward", "reward/mean", 1, "{:.3f}", "{:+.3f}"),
)


def comparison_table(before: dict[str, float], after: dict[str, float]) -> str:
    """The held-out metrics after SFT and after RL, side by side, with the change."""
    lines = [f"{'':<22}{'after SFT':>11}{'after RL':>11}{'change':>12}"]
    for label, key, scale, fmt, change in TABLE_ROWS:
        a, b = scale * before[key], scale * after[key]
        lines.append(f"{label:<22}{fmt.format(a):>11}{fmt.format(b):>11}{change.format(b - a):>12}")
    return "\n".join(lines)


def make_summary(
    before: dict[str, float], after: dict[str, float], seconds: dict[str, float], wall: float,
    size: DemoSize, quick: bool, device: str, seed: int, paths: dict[str, Path],
) -> dict[str, Any]:
    """summary.json: the names DESIGN.md promises (sft_accuracy, rl_accuracy, wall_seconds) first."""
    from posttrain.models.loading import resolve_device

    def view(m: dict[str, float]) -> dict[str, float]:
        return {"accuracy": m["accuracy"], "response_length": m["response_length/mean"],
                "reward": m["reward/mean"], "truncation_rate": m["truncation_rate"]}

    return {
        "sft_accuracy": before["accuracy"],
        "rl_accuracy": after["accuracy"],
        "gain": after["accuracy"] - before["accuracy"],
        "wall_seconds": round(wall, 1),
        "stage_seconds": {k: round(v, 1) for k, v in seconds.items()},
        "sft": view(before),
        "rl": view(after),
        "eval_problems": size.n_test,
        "sft_steps": size.sft_steps,
        "rl_steps": size.rl_steps,
        "quick": quick,
        "seed": seed,
        "device": str(resolve_device(device)),
        "paths": {k: str(v) for k, v in paths.items()},
    }


def stage(i: int, what: str, where: Path | None) -> None:
    """A header line per stage, so the bars that follow have a context."""
    print(f"\n[{i}/{STAGES}] {what}" + (f"  -> {where}" if where is not None else ""), flush=True)


@contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """`with timed(seconds, "sft"):` stores the block's wall time in seconds["sft"]."""
    t0 = time.perf_counter()
    yield
    seconds[name] = time.perf_counter() - t0


def clear_previous(out: Path) -> None:
    """Remove a previous demo's outputs from `out`; refuse when anything else is there."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    entries = list(out.iterdir())
    foreign = sorted(p.name for p in entries if not _is_demo_output(p.name))
    if foreign:
        raise ValueError(f"--out {out} holds files the demo did not write ({', '.join(foreign[:5])}); "
                         "choose a new or empty directory")
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _is_demo_output(name: str) -> bool:
    return name in OUTPUTS or (name.startswith("report-") and name.endswith(".png"))


def _paths(train: Path, test: Path, run_dir: Path) -> list[str]:
    """Path overrides, JSON-quoted so that any character in a path survives YAML parsing, and
    the task (data.train_files on the command line drops a recipe's eval.task otherwise)."""
    return [
        f"data.train_files={json.dumps([str(train)])}",
        f"data.eval_files={json.dumps([str(test)])}",
        f"trainer.output_dir={json.dumps(str(run_dir))}",
        f"eval.task={TASK}",
    ]
