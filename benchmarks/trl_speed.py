"""GRPO step time: posttrain's `GRPOTrainer` against TRL's `GRPOTrainer`, same model, same step.

    pip install -e '.[bench]'          # TRL
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trl_speed.py --out runs/bench_trl [--rounds 4] [--steps 10]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trl_speed.py --out /tmp/trl_smoke --quick   # ~1 min smoke run

Target (issue 6): seconds per GRPO step ≤ 0.5x TRL's.

The model: one Hugging Face Llama folder that both trainers load. By default the SFT
checkpoint of `benchmarks/sft_learning.py` (`runs/bench_sft/sft/final`: the built-in `tiny`
model, 1.8M parameters, trained on arithmetic, so completions stop at EOS as in real RL);
when it is missing, or with `--model random`, a randomly initialised `tiny` saved as Llama
with the byte tokenizer (its completions mostly run to max_new_tokens). posttrain loads it
as its built-in model (`model.impl=auto`: native KV-cache rollout); TRL loads it with
`AutoModelForCausalLM` (`LlamaForCausalLM`, `generate` rollout); fp32 on the CPU.

The step, the same on both sides (TRL name ↔ posttrain key):
  8 prompts per step × group 8 = 64 completions  per_device_train_batch_size=64, num_generations=8,
                                                  steps_per_generation=1 ↔ data.train_batch_size=8, rollout.n=8
  one optimizer step per rollout, one pass        gradient_accumulation_steps=1, num_iterations=1
                                                  ↔ actor.ppo_mini_batch_size=null, actor.ppo_epochs=1
  one forward/backward over all 64 rows           (TRL's batch) ↔ actor.micro_batch_size=64
                                                  (--ours-micro-batch changes ours: memory only)
  max 64 new tokens, temperature 1, no top-p/k    max_completion_length ↔ rollout.max_new_tokens
  no KL, no reference model                       beta=0 ↔ algorithm.kl.in_loss/in_reward=false
  clip ε 0.2, group-std advantages                epsilon ↔ clip_low/high; scale_rewards=group ↔ norm_adv_by_std=group
  loss aggregation (--loss)                       loss_type=grpo ↔ seq-mean-token-mean,
                                                  loss_type=dapo ↔ token-mean
  AdamW, constant lr 1e-5, no weight decay, grad-norm clip 1.0, fp32, seed 0
  reward: the arithmetic task's scorer            `posttrain.rewards.builtin.task_reward`
TRL defaults that would change the work are turned off: gradient checkpointing and bf16 (its
`GRPOConfig` defaults). Prompts: the bundled arithmetic task (`make_task`, seed 1), plain
text (non-conversational), BOS + bytes on both sides. Both skip the old-log-prob pass: the
step is fully on-policy, so the old log-probs are the loss forward's own, detached. Left as
each library does it, since it does not change the update: rows whose advantage is 0 (a
group whose 8 rewards are all equal) have a loss and gradient of exactly 0; TRL runs them,
ours counts them in the loss's denominator without a forward pass (`posttrain.workers.actor`).
The table gives their share: the speed-up depends on the task and the policy. Both sides
happen to draw the same prompts in the same order (seed 0), so the work per step matches
closely (same mean completion length); the sampled completions differ.

Measurement: each side runs in its own fresh process with one torch thread (the machine is
2 shared cores: see the rollout benchmark), --warmup steps then --steps timed steps; the
sides alternate over --rounds rounds (ours first in even rounds); ratios are per round.
Per step: wall seconds and process CPU seconds (all threads; with one thread, the time the
step actually ran, whatever the neighbours do). posttrain is driven by `rl_step`, the
function `fit` calls once per step (no checkpoint or metrics file is written); TRL by
`trainer.train()`, a step being the time between two `on_step_end` callbacks (its
per-step logging included: `logging_steps=1`).

Per-stage time per step, CPU and wall seconds:
  ours: rl_step's own stage timer (`timing/*`: gen, reward, old_logprob, adv,
        update_actor), given a CPU clock beside its wall clock by a subclass put in place
        of `rl.StageTimer` for the run; other = the step minus those stages (prompt batch,
        weight sync, metrics).
  TRL:  a subclass that only times TRL's own methods (nothing else changes): gen =
        `_generate` (tokenise, `generate`, decode), reward = `_calculate_rewards`,
        old_logprob = `_get_per_token_logps_and_entropies` called during the rollout (none
        here), adv = the rest of `_generate_and_score_completions` (advantages, padding,
        metrics), update_actor = on_step_begin → on_step_end minus the rollout (forward,
        loss, backward, clip, AdamW, scheduler), of which `compute_loss` (forward + loss)
        is shown; other = on_step_end → next on_step_begin (logging, next prompts).

Writes OUT/trl_speed.json (versions, machine, settings, every step of every run, the
summary) and prints the summary as a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "runs/bench_sft/sft/final"
LOSSES = {"grpo": "seq-mean-token-mean", "dapo": "token-mean"}
STAGES = ("gen", "reward", "old_logprob", "adv", "update_actor")


# ---------------------------------------------------------------------------- setup (parent)


def prepare_model(model: str | None, out: Path) -> tuple[Path, str]:
    """The Llama folder both sides load, and what it is."""
    path = Path(model or DEFAULT_MODEL)
    if model != "random" and (path / "config.json").is_file():
        return path, f"checkpoint {path}"
    if model not in (None, "random"):
        raise SystemExit(f"--model {model}: no config.json there")
    import torch

    from posttrain.data.tokenizer import build_tokenizer
    from posttrain.models import BuiltinLM

    path = out / "model"
    tok = build_tokenizer()
    torch.manual_seed(0)
    BuiltinLM.from_preset("tiny", len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path, "random-init tiny" + ("" if model == "random" else f" (no {DEFAULT_MODEL})")


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "trl", "accelerate")}


def machine() -> dict[str, Any]:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "")
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model or platform.processor(), "load_avg": os.getloadavg()}


def run_side(side: str, spec: dict[str, Any], out: Path, tag: str) -> dict[str, Any]:
    """One side in a fresh one-thread process; returns its per-step records."""
    spec_path, result = out / f"{tag}_{side}.spec.json", out / f"{tag}_{side}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "--worker", side, "--spec", str(spec_path), "--result", str(result)]
    subprocess.run(cmd, check=True, env=env)
    return json.loads(result.read_text())


# ---------------------------------------------------------------------------- the two sides (workers)


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.config.core import build_config
    from posttrain.trainers import rl

    overrides = [
        f"model.path={spec['model']}",
        f"data.train_batch_size={spec['prompts']}",
        "data.max_prompt_length=64",
        f"rollout.n={spec['group']}",
        f"rollout.max_new_tokens={spec['max_new_tokens']}",
        "rollout.temperature=1.0",
        "actor.ppo_epochs=1",
        f"actor.micro_batch_size={spec['ours_micro_batch']}",
        f"actor.policy_loss.loss_agg_mode={LOSSES[spec['loss']]}",
        "actor.policy_loss.clip_low=0.2",
        "actor.policy_loss.clip_high=0.2",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std=group",
        "algorithm.kl.in_loss=false",
        "algorithm.kl.in_reward=false",
        "reward.functions=[{name: task_reward, task: arithmetic}]",
        f"trainer.max_steps={spec['warmup'] + spec['steps']}",
        f"trainer.learning_rate={spec['lr']}",
        "trainer.lr_scheduler=constant",
        "trainer.weight_decay=0.0",
        "trainer.max_grad_norm=1.0",
        "trainer.report_to=[]",
        "trainer.progress=false",
        f"trainer.output_dir={spec['out']}/ours_run",
        "trainer.resume=never",
        "trainer.overwrite=true",
        "trainer.seed=0",
        *spec["ours_overrides"],
    ]
    cfg = build_config(GRPOConfig, None, overrides)

    class TwoClocks(rl.StageTimer):
        """posttrain's StageTimer (wall, for timing/*) plus the process CPU time of each stage."""

        last: TwoClocks | None = None

        def __init__(self, stages):
            super().__init__(stages)
            self.cpu = dict.fromkeys(self.seconds, 0.0)
            TwoClocks.last = self

        @contextlib.contextmanager
        def __call__(self, stage):
            start = time.process_time()
            try:
                with super().__call__(stage):
                    yield
            finally:
                self.cpu[stage] += time.process_time() - start

    rl.StageTimer = TwoClocks  # what rl_step instantiates; timing/* stay as they are
    torch.set_num_threads(1)
    trainer = GRPOTrainer(args=cfg, train_dataset=spec["rows"])
    records = []
    for step in range(1, cfg.trainer.max_steps + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        metrics, batch = rl.rl_step(trainer, step)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        stages = {s: metrics[f"timing/{s}"] for s in STAGES}
        stages["other"] = wall - sum(stages.values())
        cpu_stages = {s: TwoClocks.last.cpu[s] for s in STAGES}
        cpu_stages["other"] = cpu - sum(cpu_stages.values())
        records.append({"wall": wall, "cpu": cpu, "stages": stages, "cpu_stages": cpu_stages,
                        "completion_len": metrics["response_length/mean"], "reward": metrics["reward/mean"],
                        **update_work(local_actor(trainer), batch)})
    return {"overrides": overrides, "steps": records}


def local_actor(trainer):
    """The `Actor` of the run's one in-process worker (trainer.backend=local)."""
    return next(g.worker.actor for g in trainer.roles.pools.groups.values() if getattr(g.worker, "actor", None))


def update_work(actor, batch) -> dict[str, float]:
    """What the update ran (recomputed after the timed step, unshuffled): the share of rows
    it skipped (advantage 0 everywhere), and the real tokens and token positions through
    the projections and MLP (real plus padding: the padded rows, or with
    model.use_remove_padding the packed ones: the built-in model's one row of real tokens)
    of the micro-batches its forward passes ran over."""
    from posttrain.workers.actor import ZeroAdvantageRows
    from posttrain.workers.forward import builtin_of, pack_responses

    parts = actor.update_parts(batch)
    ran = [p for p in parts if not isinstance(p, ZeroAdvantageRows)]
    skipped = sum(len(p.batch) for p in parts if isinstance(p, ZeroAdvantageRows))
    one_row = builtin_of(actor.model) is not None
    positions = [pack_responses(p, one_row).rows.input_ids.numel() if actor.remove_padding
                 else p.input_ids[:, :-1].numel() for p in ran]
    return {"zero_adv_frac": skipped / len(batch),
            "real_tokens": sum(int(p.token_counts().sum() - len(p)) for p in ran), "padded_tokens": sum(positions)}


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.rewards.builtin import task_reward

    timed = ("_generate_and_score_completions", "_generate", "_calculate_rewards",
             "_get_per_token_logps_and_entropies", "compute_loss")
    missing = [m for m in timed if not hasattr(GRPOTrainer, m)]
    if missing:  # private methods: a TRL that renamed them would leave the stage timers silently at 0
        raise SystemExit(f"this TRL's GRPOTrainer lacks {missing}; the stage timers were written for TRL 1.16")
    score = task_reward("arithmetic")

    def arithmetic_reward(prompts, completions, answer, **_):
        """TRL's reward signature around posttrain's arithmetic scorer (the same call ours makes)."""
        return score(prompts, completions, answer)

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer with wall-clock timers around four of its methods; nothing else changes."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.clock: dict[str, list[float]] = {}  # name -> [wall, cpu] seconds this step
            self.in_rollout = False

        def _timed(self, name, fn, *a, **kw):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                acc = self.clock.setdefault(name, [0.0, 0.0])
                acc[0] += time.perf_counter() - wall
                acc[1] += time.process_time() - cpu

        def _generate_and_score_completions(self, inputs):
            self.in_rollout = True
            try:
                return self._timed("rollout", super()._generate_and_score_completions, inputs)
            finally:
                self.in_rollout = False

        def _generate(self, prompts):
            return self._timed("gen", super()._generate, prompts)

        def _calculate_rewards(self, *a, **kw):
            return self._timed("reward", super()._calculate_rewards, *a, **kw)

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            name = "old_logprob" if self.in_rollout else "logprob_in_loss"
            return self._timed(name, super()._get_per_token_logps_and_entropies, *a, **kw)

        def compute_loss(self, *a, **kw):
            return self._timed("update_forward", super().compute_loss, *a, **kw)

    records: list[dict[str, Any]] = []

    class StepClock(TrainerCallback):
        """A step is on_step_end → on_step_end; `other` is its part before on_step_begin
        (the previous step's logging and this step's batch of prompts)."""

        def on_train_begin(self, args, state, control, **kw):
            self.mark = (time.perf_counter(), time.process_time())

        def on_step_begin(self, args, state, control, **kw):
            self.begin = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kw):
            now = (time.perf_counter(), time.process_time())
            clocks = []
            for k in (0, 1):  # wall, then CPU
                c = {name: v[k] for name, v in trainer.clock.items()}
                rollout = c.get("rollout", 0.0)
                clocks.append({
                    "gen": c.get("gen", 0.0), "reward": c.get("reward", 0.0), "old_logprob": c.get("old_logprob", 0.0),
                    "adv": rollout - c.get("gen", 0.0) - c.get("reward", 0.0) - c.get("old_logprob", 0.0),
                    "update_actor": now[k] - self.begin[k] - rollout,
                    "other": self.begin[k] - self.mark[k],
                    "update_forward": c.get("update_forward", 0.0),
                })
            records.append({"wall": now[0] - self.mark[0], "cpu": now[1] - self.mark[1],
                            "stages": clocks[0], "cpu_stages": clocks[1]})
            trainer.clock, self.mark = {}, now

        def on_log(self, args, state, control, logs=None, **kw):
            if records and logs and "completions/mean_length" in logs:  # logging_steps=1: this step's logs
                records[-1]["completion_len"] = logs["completions/mean_length"]
                records[-1]["reward"] = logs.get("reward")

    torch.set_num_threads(1)
    n_rows = spec["prompts"] * spec["group"]
    args = GRPOConfig(
        output_dir=f"{spec['out']}/trl_run",
        per_device_train_batch_size=n_rows,
        gradient_accumulation_steps=1,
        num_generations=spec["group"],
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        loss_type=spec["loss"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=spec["warmup"] + spec["steps"],
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True)
    clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=[arithmetic_reward], args=args, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(spec["rows"]), callbacks=[clock],
    )
    trainer.train()
    return {"args": {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
            "model_class": type(model).__name__, "steps": records}


# ---------------------------------------------------------------------------- summary


def summarise(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per side: median over runs of the mean over timed steps; ratios per round (adjacent runs)."""
    sides: dict[str, Any] = {}
    for side in ("ours", "trl"):
        timed = [r["steps"][warmup:] for r in runs if r["side"] == side]
        per_run = [{"wall": statistics.fmean(s["wall"] for s in steps),
                    "cpu": statistics.fmean(s["cpu"] for s in steps),
                    "stages": {k: statistics.fmean(s["stages"][k] for s in steps) for k in steps[0]["stages"]},
                    "cpu_stages": {k: statistics.fmean(s["cpu_stages"][k] for s in steps)
                                   for k in steps[0]["cpu_stages"]},
                    "completion_len": statistics.fmean(s.get("completion_len", float("nan")) for s in steps),
                    "reward": statistics.fmean(s.get("reward") or 0.0 for s in steps),
                    "real_token_frac": sum(s.get("real_tokens", 0) for s in steps)
                    / max(1, sum(s.get("padded_tokens", 0) for s in steps)),
                    "zero_adv_frac": statistics.fmean(s.get("zero_adv_frac", float("nan")) for s in steps)}
                   for steps in timed]
        sides[side] = {
            "per_run": per_run,
            "wall": statistics.median(r["wall"] for r in per_run),
            "cpu": statistics.median(r["cpu"] for r in per_run),
            "stages": {k: statistics.median(r["stages"][k] for r in per_run) for k in per_run[0]["stages"]},
            "cpu_stages": {k: statistics.median(r["cpu_stages"][k] for r in per_run) for k in per_run[0]["cpu_stages"]},
            "completion_len": statistics.median(r["completion_len"] for r in per_run),
            "reward": statistics.median(r["reward"] for r in per_run),
            "real_token_frac": statistics.median(r["real_token_frac"] for r in per_run),
            "zero_adv_frac": statistics.median(r["zero_adv_frac"] for r in per_run),
        }
    ratios = {k: [o[k] / t[k] for o, t in zip(sides["ours"]["per_run"], sides["trl"]["per_run"])]
              for k in ("wall", "cpu")}
    return {**sides, "ratio": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                               for k, v in ratios.items()}}


def table(summary: dict[str, Any]) -> str:
    o, t, r = summary["ours"], summary["trl"], summary["ratio"]
    lines = [
        "| | posttrain | TRL | ours ÷ TRL |",
        "|---|---|---|---|",
        f"| s/step, CPU | {o['cpu']:.2f} | {t['cpu']:.2f} | **{r['cpu']['median']:.2f}x** "
        f"[{r['cpu']['min']:.2f}–{r['cpu']['max']:.2f}] |",
        f"| s/step, wall | {o['wall']:.2f} | {t['wall']:.2f} | {r['wall']['median']:.2f}x "
        f"[{r['wall']['min']:.2f}–{r['wall']['max']:.2f}] |",
    ]
    for k in (*STAGES, "other"):
        oc, tc = o["cpu_stages"][k], t["cpu_stages"][k]
        ratio = f"{oc / tc:.2f}x" if tc > 1e-3 else "–"
        lines.append(f"| {k}: CPU s (wall s) | {oc:.3f} ({o['stages'][k]:.3f}) | {tc:.3f} ({t['stages'][k]:.3f}) "
                     f"| {ratio} |")
    lines.append(f"| TRL update_actor: of which forward + loss (`compute_loss`) | – | "
                 f"{t['cpu_stages']['update_forward']:.3f} ({t['stages']['update_forward']:.3f}) | – |")
    lines.append(f"| mean completion length (tokens) | {o['completion_len']:.1f} | {t['completion_len']:.1f} | – |")
    lines.append(f"| rows the update skipped (advantage 0) | {100 * o['zero_adv_frac']:.0f}% | 0% | – |")
    lines.append(f"| real (not padding) tokens in the update's forward passes | {100 * o['real_token_frac']:.0f}% "
                 f"| – | – |")
    lines.append(f"| mean reward | {o['reward']:.3f} | {t['reward']:.3f} | – |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_trl")
    p.add_argument("--model", default=None, help=f"Llama folder both sides load, or `random` for a random-init tiny "
                   f"model (default {DEFAULT_MODEL} when it exists, else random)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating the order")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--loss", choices=sorted(LOSSES), default="grpo", help="TRL loss_type (ours: its aggregation)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--ours-micro-batch", type=int, default=None,
                   help="posttrain's actor.micro_batch_size, rows per forward/backward (memory only; cut from "
                        "rows sorted by length); default all rows, as TRL")
    p.add_argument("--ours-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra posttrain config override (e.g. algorithm.rollout_correction.bypass_mode=true)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 1 warm-up + 2 steps, 4 × 4 rows")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        result = (worker_ours if args.worker == "ours" else worker_trl)(spec)
        Path(args.result).write_text(json.dumps(result))
        return
    if args.quick:
        args.rounds, args.warmup, args.steps, args.prompts, args.group = 1, 1, 2, 4, 4
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'") from None
    from posttrain.data.tasks import make_task

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, model_desc = prepare_model(args.model, out)
    paths = make_task("arithmetic", out / "data", n_train=2000, n_test=0, seed=1)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    spec = {"model": str(model), "rows": rows, "out": str(out), "prompts": args.prompts, "group": args.group,
            "max_new_tokens": args.max_new_tokens, "loss": args.loss, "lr": args.lr,
            "warmup": args.warmup, "steps": args.steps,
            "ours_micro_batch": args.ours_micro_batch or args.prompts * args.group,
            "ours_overrides": args.ours_override}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    info = {"date": started, "machine": machine(), "versions": versions(), "model": model_desc,
            "settings": {k: v for k, v in spec.items() if k != "rows"}}
    runs = []
    for rnd in range(args.rounds):
        for side in (("ours", "trl") if rnd % 2 == 0 else ("trl", "ours")):
            print(f"round {rnd}: {side} ...", flush=True)
            res = run_side(side, spec, out, f"round{rnd}")
            runs.append({"side": side, "round": rnd, **res})
            timed = res["steps"][args.warmup:]
            print(f"  {side}: {statistics.fmean(s['wall'] for s in timed):.2f} s/step wall, "
                  f"{statistics.fmean(s['cpu'] for s in timed):.2f} s/step CPU", flush=True)
    summary = summarise(runs, args.warmup)
    info["machine"]["load_avg_end"] = os.getloadavg()
    (out / "trl_speed.json").write_text(json.dumps({**info, "summary": summary, "runs": runs}, indent=1))
    print(json.dumps(info, indent=1))
    print(table(summary))
    target = summary["ratio"]["cpu"]["median"] <= 0.5
    print(f"target ≤ 0.5x TRL's time (CPU): {'met' if target else 'NOT met'}")


if __name__ == "__main__":
    main()
