"""The seed's memory levers (issue 32 item 5): gradient checkpointing and remove padding.

    PYTHONPATH=src .venv/bin/python benchmarks/memory_levers.py checkpointing --out runs/bench_levers
    PYTHONPATH=src .venv/bin/python benchmarks/memory_levers.py remove-padding --out runs/bench_levers \
        --model runs/bench_sft/sft/final [--steps 4] [--repeats 5]

checkpointing (goal: peak activation memory with `model.gradient_checkpointing=true` on a
1024-token batch ≤ 40% of without). One training step (forward, next-token loss, backward)
of a fresh built-in `small` model (H 512, L 8, I 1408, V 320: 25.9M parameters) and of a
transformers `LlamaForCausalLM` of the same shape, float32, on --rows × --tokens random
tokens (default 4 × 256 = 1024). Each setting runs in its own fresh process (glibc's mmap
threshold fixed at 64 KiB, `WORKER_ENV`, so freed tensors leave the resident set): the
parameters' gradients are allocated first (zeros), the peak-RSS counter is reset (`echo 5 >
/proc/self/clear_refs`), the step runs, and the activation memory is the peak resident set
(VmHWM) minus the resident set before the step: what the step held at its peak beyond the
weights and gradients (saved activations, the layer being recomputed and its backward's
temporaries, the logits). Two steps run on the same batch; the second (warm) is reported, the
first (cold) is shown beside it: the first call of `torch.utils.checkpoint.checkpoint`
imports `torch._dynamo` (its `torch._disable_dynamo` wrapper; ~800 modules with sympy, ~70 MB
resident), which a process that imported transformers' modeling code has already paid, so a
cold step charges the built-in model for code, not activations. The same loss and gradients
with and without are checked (max |Δ|).

remove-padding (goal: the demo task's RL update ≤ 0.65x the padded one's time). The GRPO
step of `benchmarks/trl_speed.py` on the demo's SFT model (8 prompts × 8 completions of at
most 64 tokens, one optimizer step over all 64 rows in one micro-batch, entropy_coeff
1e-12 so no row is skipped, fp32, one thread): --steps rollouts are generated once by the
padded run's trainer (`rl_step`), then two actors on copies of the same weights update on
those same batches, alternating (padded, packed, padded, ...) --repeats times, each update
timed (process CPU seconds and wall seconds) — the update as `rl_step` runs it: forward,
loss, backward, AdamW. Reported: median CPU seconds per update of each, their ratio, and the
token positions each layout computes: through the projections and MLP (padded (B, Tp + Tr − 1);
packed: the real tokens, one row) and through attention (the packed sequences regrouped into
rows as wide as the longest, `models.document_rows`; Σ rows × width² against B × (Tp + Tr − 1)²).

Writes OUT/memory_levers_<mode>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# glibc's mmap threshold fixed at 64 KiB: every tensor above it is its own mapping, returned to
# the OS when freed, so the resident set follows the live tensors rather than the heap's high
# water (with the default, growing threshold, freed activations stay in the heap: the builtin
# model's checkpointed step then read 301 MB where its live peak is ~155 MB).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8)


# ------------------------------------------------------------------------ checkpointing


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def checkpointing_worker(impl: str, on: bool, rows: int, tokens: int) -> dict[str, Any]:
    """One training step in this (fresh) process; returns its peak memory beyond the start."""
    import torch

    from posttrain.models import BuiltinLM, next_token_loss
    from posttrain.models.loading import enable_gradient_checkpointing, forward_logits

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if impl == "builtin":
        model = BuiltinLM.from_preset("small", 320)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=320, tie_word_embeddings=True, attn_implementation="sdpa",
                                             **SMALL))
    if on:
        enable_gradient_checkpointing(model)
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(3, 320, (rows, tokens), generator=torch.Generator().manual_seed(1))
    steps = []
    for _ in range(2):  # the first step (cold) pays one-time costs; the second (warm) is what is reported
        for p in model.parameters():
            p.grad.zero_()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = rss_kb("VmRSS")
        start = time.process_time()
        loss = next_token_loss(forward_logits(model, ids), ids)
        loss.backward()
        seconds = time.process_time() - start
        steps.append(((rss_kb("VmHWM") - before) / 1024, before / 1024, seconds))
    (cold_mb, _, _), (warm_mb, before_mb, seconds) = steps
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"impl": impl, "checkpointing": on, "parameters": sum(p.numel() for p in model.parameters()),
            "activation_mb": warm_mb, "cold_activation_mb": cold_mb, "rss_before_mb": before_mb, "cpu_s": seconds,
            "loss": float(loss.detach()), "grad": grad[:: max(1, len(grad) // 200_000)].tolist()}


def run_checkpointing(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    for impl in ("builtin", "hf"):
        for on in (False, True):
            spec = out / f"gc_{impl}_{on}.json"
            subprocess.run([sys.executable, __file__, "checkpointing-worker", "--impl", impl,
                            *(["--on"] if on else []), "--rows", str(args.rows), "--tokens", str(args.tokens),
                            "--result", str(spec)], check=True, env={**os.environ, **WORKER_ENV})
            results[f"{impl}/{on}"] = json.loads(spec.read_text())
    summary = {}
    for impl in ("builtin", "hf"):
        off, on = results[f"{impl}/False"], results[f"{impl}/True"]
        summary[impl] = {
            "without_mb": off["activation_mb"], "with_mb": on["activation_mb"],
            "ratio": on["activation_mb"] / off["activation_mb"],
            "cold_mb": (off["cold_activation_mb"], on["cold_activation_mb"]),
            "cpu_s": (off["cpu_s"], on["cpu_s"]),
            "loss_diff": abs(off["loss"] - on["loss"]),
            "grad_diff": max(abs(a - b) for a, b in zip(off["grad"], on["grad"], strict=True)),
        }
    lines = [f"| model ({args.rows * args.tokens} tokens: {args.rows} × {args.tokens}) | activation MB without | "
             "with | with ÷ without | first step's MB (without / with) | step CPU s (without / with) | "
             "max abs Δ loss, gradient |",
             "|---|---|---|---|---|---|---|"]
    for impl, s in summary.items():
        lines.append(f"| {impl} | {s['without_mb']:.0f} | {s['with_mb']:.0f} | **{s['ratio']:.2f}** | "
                     f"{s['cold_mb'][0]:.0f} / {s['cold_mb'][1]:.0f} | "
                     f"{s['cpu_s'][0]:.2f} / {s['cpu_s'][1]:.2f} | {s['loss_diff']:.1e}, {s['grad_diff']:.1e} |")
    for r in results.values():
        r.pop("grad")
    return {"runs": results, "summary": summary, "table": "\n".join(lines)}


# ------------------------------------------------------------------------ remove padding


def remove_padding_overrides(model: str, out: Path, steps: int) -> list[str]:
    """trl_speed.py's GRPO step (its `worker_ours` overrides) with no skippable row."""
    return [
        f"model.path={model}", "data.train_batch_size=8", "data.max_prompt_length=64", "rollout.n=8",
        "rollout.max_new_tokens=64", "rollout.temperature=1.0", "actor.ppo_epochs=1", "actor.micro_batch_size=64",
        "actor.policy_loss.loss_agg_mode=seq-mean-token-mean", "actor.policy_loss.clip_low=0.2",
        "actor.policy_loss.clip_high=0.2", "actor.entropy_coeff=1e-12", "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std=group", "algorithm.kl.in_loss=false", "algorithm.kl.in_reward=false",
        "reward.functions=[{name: task_reward, task: arithmetic}]", f"trainer.max_steps={steps}",
        "trainer.learning_rate=1e-5", "trainer.lr_scheduler=constant", "trainer.weight_decay=0.0",
        "trainer.max_grad_norm=1.0", "trainer.report_to=[]", "trainer.progress=false",
        f"trainer.output_dir={out}/rp_run", "trainer.resume=never", "trainer.overwrite=true", "trainer.seed=0",
    ]


def run_remove_padding(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.config.core import build_config
    from posttrain.data.tasks import make_task
    from posttrain.models.document_rows import document_rows
    from posttrain.trainers import rl
    from posttrain.workers import Actor
    from posttrain.workers.forward import micro_batches, pack_responses

    torch.set_num_threads(1)
    paths = make_task("arithmetic", out / "data", n_train=2000, n_test=0, seed=1)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    cfg = build_config(GRPOConfig, None, remove_padding_overrides(args.model, out, args.steps))
    trainer = GRPOTrainer(args=cfg, train_dataset=rows)
    policy = trainer.roles.actor.model()  # the in-process worker's own module
    start = copy.deepcopy(policy.state_dict())
    batches = [rl.rl_step(trainer, step)[1] for step in range(1, args.steps + 1)]
    actors = {}
    for name, packed in (("padded", False), ("packed", True)):
        c = copy.deepcopy(cfg)
        c.model.use_remove_padding = packed
        model = copy.deepcopy(policy)
        model.load_state_dict(start)
        actors[name] = Actor(model, c, cfg.trainer.max_steps)
    tokens = {"real": 0, "padded": 0, "packed": 0, "rows_layout": 0, "attention_rows": 0, "padded_rows_sq": 0,
              "attention_rows_sq": 0}
    for b in batches:
        for mb in micro_batches(b, 64, by_length=True):
            rows = pack_responses(mb, one_row=True).rows
            attention = document_rows(rows.position_ids)
            tokens["real"] += int((mb.prompt_mask.sum(1) + mb.trajectory_lengths - 1).sum())
            tokens["padded"] += mb.input_ids[:, :-1].numel()
            tokens["packed"] += rows.input_ids.numel()
            tokens["rows_layout"] += pack_responses(mb).rows.input_ids.numel()  # a transformers model's layout
            tokens["attention_rows"] += attention.rows * attention.width
            tokens["padded_rows_sq"] += mb.input_ids.shape[0] * (mb.input_ids.shape[1] - 1) ** 2
            tokens["attention_rows_sq"] += attention.rows * attention.width**2
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in actors}
    for rep in range(args.repeats):
        for i, b in enumerate(batches):
            order = ("padded", "packed") if (rep + i) % 2 == 0 else ("packed", "padded")
            for name in order:
                wall, cpu = time.perf_counter(), time.process_time()
                actors[name].update(b, mini_batch_rows=len(b), epochs=1, kl_coef=0.0, seed=rep)
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    # Pairs of the same batch and repeat: the ratio per pair, then its median.
    ratios = [p[0] / q[0] for p, q in zip(times["packed"], times["padded"], strict=True)]
    summary = {
        name: {"cpu_s": statistics.median(t[0] for t in ts), "wall_s": statistics.median(t[1] for t in ts)}
        for name, ts in times.items()
    }
    summary["ratio_cpu"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    summary["tokens"] = tokens
    summary["completion_len"] = statistics.fmean(float(b.lengths.float().mean()) for b in batches)
    t = tokens
    table = "\n".join([
        "| update (64 rows, one micro-batch) | padded | packed (`model.use_remove_padding=true`) | packed ÷ padded |",
        "|---|---|---|---|",
        f"| CPU s per update (median) | {summary['padded']['cpu_s']:.3f} | {summary['packed']['cpu_s']:.3f} | "
        f"**{summary['ratio_cpu']['median']:.2f}x** [{summary['ratio_cpu']['min']:.2f}–"
        f"{summary['ratio_cpu']['max']:.2f}] |",
        f"| wall s per update (median) | {summary['padded']['wall_s']:.3f} | {summary['packed']['wall_s']:.3f} | – |",
        f"| token positions through the projections and MLP ({args.steps} batches) | {t['padded']} "
        f"({100 * t['real'] / t['padded']:.0f}% real) | {t['packed']} ({100 * t['real'] / t['packed']:.0f}% real) | "
        f"{t['packed'] / t['padded']:.2f}x |",
        f"| the same, packed into rows as wide as the longest sequence (a transformers model's layout) | – | "
        f"{t['rows_layout']} ({100 * t['real'] / t['rows_layout']:.0f}% real) | {t['rows_layout'] / t['padded']:.2f}x |",
        f"| attention: query positions; Σ rows × width² | {t['padded']}; {t['padded_rows_sq']} | "
        f"{t['attention_rows']} ({100 * t['real'] / t['attention_rows']:.0f}% real); {t['attention_rows_sq']} | "
        f"{t['attention_rows_sq'] / t['padded_rows_sq']:.2f}x |",
    ])
    return {"settings": remove_padding_overrides(args.model, out, args.steps), "times": times,
            "summary": summary, "table": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["checkpointing", "remove-padding", "checkpointing-worker"])
    p.add_argument("--out", default="runs/bench_levers")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--model", default="runs/bench_sft/sft/final", help="the demo's SFT model (remove-padding)")
    p.add_argument("--steps", type=int, default=4, help="rollouts to update on (remove-padding)")
    p.add_argument("--repeats", type=int, default=5, help="updates per rollout and layout (remove-padding)")
    p.add_argument("--impl", choices=["builtin", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode == "checkpointing-worker":
        Path(args.result).write_text(json.dumps(checkpointing_worker(args.impl, args.on, args.rows, args.tokens)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = run_checkpointing(args, out) if args.mode == "checkpointing" else run_remove_padding(args, out)
    result.update(date=started, load_avg=os.getloadavg(), nproc=os.cpu_count())
    (out / f"memory_levers_{args.mode}.json").write_text(json.dumps(result, indent=1))
    print(result["table"])


if __name__ == "__main__":
    main()
