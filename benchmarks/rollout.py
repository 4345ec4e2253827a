"""Rollout throughput: the native engine against the hf engine, side by side.

    .venv/bin/python benchmarks/rollout.py [--presets tiny small] [--repeats 3] [--threads N]
        [--arch llama|qwen2|qwen3|mistral]
    .venv/bin/python benchmarks/rollout.py --presets tiny --threads 1 --profile   # native's top ops

Workload (both engines, same prompts and weights): 64 arithmetic-task prompts, one
sample each, 128 new tokens per row with early stopping off (`stop_token_ids=[]`),
temperature 1, fp32, a randomly initialised built-in preset over the byte
tokenizer (V = 262), of the family `--arch` (ARCHS: Llama by default; qwen3 is
Qwen3-shaped: q/k RMSNorm, nkv = nh/2 and head_dim = 2·H/nh, so nh·D = 2H as in
Qwen3-0.6B's 16 x 128 = 2 x 1024). The hf engine runs that family's transformers
`generate` (`LlamaForCausalLM`, `Qwen3ForCausalLM`, ...) on the same weights loaded by
plain transformers and, like the native engine, returns logprobs (its teacher-forced
recompute is part of its cost); "hf generate only" skips them.

Reported per engine: generated tokens per CPU-second (median over repeats), the
achieved GFLOP per CPU-second of the work a KV-cached decoder must do, and its
share of the fp32 matmul peak measured the same way in the same run (best of 5
2048 x 2048 torch.mm). CPU time, not wall time, because the machine is shared:
with one thread (--threads 1) it is the time the engine actually ran. Per row with
p prompt tokens and S new tokens:

    FLOPs = 2·N_blk·(p + S) + 2·H·V·S + 2·L·nh·D·(p + S)(p + S + 1)

N_blk = parameters of the decoder blocks' linear layers, H·V the output head
(applied to S positions), and the last term QK^T + AV (2·D each per head and
(query, key) pair) when position j attends j keys. The ratio native/hf is taken
per repeat (the runs are adjacent in time) and given as median [min–max], by CPU
time and by wall clock.

Two last rows per preset bound what an fp32 engine could do on this machine (roofline):
the matmuls at the measured matmul peak plus every cached key and value read once per
decode step at a measured read bandwidth (`decode_floor_s`), and the speed-up over the hf
engine that this floor would give. "cache-resident" reads at the rate of a 32 MB `sum` (a
lower bound on any engine); "from memory" at the rate of a 256 MB one, which is what
decoding gets once every layer's cache and the weights are in play (measured in place, see
benchmarks/README.md).

A second table measures the compaction policy (`compact_fraction`) on a workload
where rows stop at different times, as in RL: tiny preset, 8 stop tokens of the
262 ids, so a row ends with probability ~3% per step; the hf engine runs the same
workload (it keeps finished rows in the batch until the last one stops).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
import time

import torch

from posttrain.data.tasks import get_task
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import PRESETS, BuiltinLM
from posttrain.rollout import SamplingParams, make_engine

BATCH, NEW_TOKENS = 64, 128
ARCHS = {
    "llama": lambda preset: {},
    "qwen2": lambda preset: {"model_type": "qwen2"},
    "qwen3": lambda preset: {
        "model_type": "qwen3",
        "num_key_value_heads": PRESETS[preset]["num_attention_heads"] // 2,
        "head_dim": 2 * PRESETS[preset]["hidden_size"] // PRESETS[preset]["num_attention_heads"],
    },
    "mistral": lambda preset: {"model_type": "mistral"},
}
"""`BuiltinConfig` overrides of each `--arch` on a preset."""


def matmul_peak_gflops(size: int = 2048, tries: int = 5) -> float:
    """fp32 GFLOP per CPU-second of a large torch.mm (best of `tries`)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(_timed(lambda: a @ b)[1] for _ in range(tries))
    return 2 * size**3 / best / 1e9


def read_bandwidth_gbs(mb: int = 32, tries: int = 10) -> float:
    """GB per CPU-second that one `sum` streams from a fp32 tensor of `mb` MB (best of
    `tries`): a KV cache of this size is read at about this rate, at best."""
    x = torch.randn(mb * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum)[1] for _ in range(tries))
    return mb * 2**20 / best / 1e9


def _timed(fn):
    """(wall seconds, process CPU seconds, fn())."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def block_parameters(model: BuiltinLM) -> int:
    """N_blk: parameters of the decoder blocks' linear layers (the output head excluded)."""
    return sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    )


def decode_flops(model: BuiltinLM, prompt_lens: list[int], new_tokens: int) -> float:
    """The formula in the module docstring, summed over rows."""
    c, n_blk = model.config, block_parameters(model)
    head = c.hidden_size * c.vocab_size
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim
    return float(
        sum(
            2 * n_blk * (p + new_tokens)
            + 2 * head * new_tokens
            + attn * (p + new_tokens) * (p + new_tokens + 1)
            for p in prompt_lens
        )
    )


def decode_floor_s(
    model: BuiltinLM, prompt_lens: list[int], new_tokens: int, peak: float, bandwidth: float
) -> float:
    """A lower bound on the CPU seconds any fp32 engine needs for the workload (roofline):
    the matmuls at the measured peak, `(2·N_blk·(p + S) + 2·H·V·S) / peak`, plus reading
    every cached key and value once per decode step at the measured read bandwidth,
    `Σ_rows Σ_{j=p+1}^{p+S-1} 2·L·nkv·D·4 bytes · j / bandwidth` (the step that feeds
    position j reads j cached positions), each at its own roof."""
    c, n_blk = model.config, block_parameters(model)
    matmul = sum(
        2 * n_blk * (p + new_tokens) + 2 * c.hidden_size * c.vocab_size * new_tokens
        for p in prompt_lens
    )
    per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    kv = sum(per_position * sum(range(p + 1, p + new_tokens)) for p in prompt_lens)
    return matmul / (peak * 1e9) + kv / (bandwidth * 1e9)


def build_models(preset: str, vocab: int, tmp: str, arch: str = "llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = BuiltinLM.from_preset(
        preset, vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, **ARCHS[arch](preset)
    ).eval()
    model.save_pretrained(tmp)
    hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True).eval()
    return model, hf


def bench_preset(
    preset: str, prompts: list[str], tok, repeats: int, peak: float, bandwidths: dict[str, float],
    arch: str = "llama",
) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        model, hf = build_models(preset, len(tok), tmp, arch)
        runs = {
            "native": (make_engine("native", model, tok), True),
            "hf": (make_engine("hf", hf, tok), True),
            "hf generate only": (make_engine("hf", hf, tok), False),
        }
        prompt_lens = [len(tok(p)["input_ids"]) for p in prompts]
        flops = decode_flops(model, prompt_lens, NEW_TOKENS)
        for engine, _ in runs.values():  # warm-up
            engine.generate(prompts[:4], SamplingParams(max_new_tokens=4))
        results = {name: [] for name in runs}
        for rep in range(repeats):
            order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
            for name in order:
                engine, logprobs = runs[name]
                params = SamplingParams(
                    max_new_tokens=NEW_TOKENS, stop_token_ids=[], seed=rep, logprobs=logprobs
                )
                wall, cpu, out = _timed(lambda e=engine, p=params: e.generate(prompts, p))
                assert out.num_tokens == BATCH * NEW_TOKENS, out.num_tokens
                results[name].append((wall, cpu))
                print(
                    f"  {preset} rep {rep} {name}: {wall:.2f} s wall, {cpu:.2f} s cpu", flush=True
                )
    rows = []
    tokens = BATCH * NEW_TOKENS
    for name, times in results.items():
        cpu = statistics.median(t[1] for t in times)
        cells = ["–", "–"]
        if name != "native":
            cells = []
            for k in (1, 0):  # cpu time, then wall clock
                r = [h[k] / n[k] for n, h in zip(results["native"], times)]
                cells.append(f"{statistics.median(r):.2f}x [{min(r):.2f}–{max(r):.2f}]")
        rows.append(
            f"| {preset}{'' if arch == 'llama' else ' ' + arch} ({model.num_parameters() / 1e6:.1f}M) "
            f"| {name} | {tokens / cpu:,.0f} "
            f"| {flops / cpu / 1e9:.1f} | {100 * flops / cpu / 1e9 / peak:.0f}% "
            f"| {cells[0]} | {cells[1]} |"
        )
    hf_cpu = statistics.median(h[1] for h in results["hf"])
    for where, bandwidth in bandwidths.items():
        floor = decode_floor_s(model, prompt_lens, NEW_TOKENS, peak, bandwidth)
        rows.append(
            f"| {preset} | roofline floor, KV {where} | {tokens / floor:,.0f} "
            f"| {flops / floor / 1e9:.1f} | {100 * flops / floor / 1e9 / peak:.0f}% "
            f"| ≤ {hf_cpu / floor:.2f}x over hf | – |"
        )
    return rows


def bench_compaction(prompts: list[str], tok, repeats: int, arch: str = "llama") -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        model, hf = build_models("tiny", len(tok), tmp, arch)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=list(range(100, 108)), seed=0)
    runs = {
        f"native, compact_fraction={f}" + (" (default)" if f == 0.25 else ""): make_engine(
            "native", model, tok, compact_fraction=f
        )
        for f in (None, 0.0, 0.25, 0.5)
    }
    runs["hf (finished rows stay in the batch)"] = make_engine("hf", hf, tok)
    for engine in runs.values():
        engine.generate(prompts[:4], SamplingParams(max_new_tokens=4))
    times = {name: [] for name in runs}
    outs = {}
    for _ in range(repeats):
        for name, engine in runs.items():
            wall, cpu, outs[name] = _timed(lambda e=engine: e.generate(prompts, params))
            times[name].append((wall, cpu))
    base = outs["native, compact_fraction=None"]
    rows = []
    for name, out in outs.items():
        # Same seed, same exponential-race draws: every policy (and hf) samples the same rows.
        assert torch.equal(out.response_ids, base.response_ids), name
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        rows.append(
            f"| {name} | {out.num_tokens} | {out.meta['decode_steps']} "
            f"| {out.meta.get('compactions', '–')} | {cpu:.2f} | {wall:.2f} "
            f"| {out.num_tokens / cpu:,.0f} |"
        )
    lengths = base.lengths.float()
    rows.append(
        f"\nlengths: mean {lengths.mean():.1f}, median {lengths.median():.0f}, "
        f"max {lengths.max():.0f}; {base.finish_reason.count('length')} of {BATCH} rows hit 128"
    )
    return rows


def profile(preset: str, prompts: list[str], tok, arch: str = "llama") -> None:
    """Where the native engine's time goes: its top ops in one run. (transformers'
    generate is not shown: under the profiler its cache torch.cat slows down ~7x.)"""
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build_models(preset, len(tok), tmp, arch)
    engine = make_engine("native", model, tok)
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=4))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=[], seed=0)
    with torch.profiler.profile() as prof:
        engine.generate(prompts, params)
    top = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50
    )
    print(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="only profile the first preset's ops"
    )
    parser.add_argument("--arch", choices=list(ARCHS), default="llama", help="model family (ARCHS)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    prompts = [r["prompt"] for r in get_task("arithmetic").generate(BATCH, random.Random(0))]
    if args.profile:
        return profile(args.presets[0], prompts, tok, args.arch)
    peak = matmul_peak_gflops()
    bandwidths = {"cache-resident": read_bandwidth_gbs(32), "from memory": read_bandwidth_gbs(256, tries=4)}
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpu.splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M %Z')}, {model_name}, torch {torch.__version__}, arch {args.arch}, "
        f"{torch.get_num_threads()} threads; fp32 matmul peak {peak:.0f} GFLOP per CPU-second, "
        f"read bandwidth {bandwidths['cache-resident']:.1f} (32 MB) / "
        f"{bandwidths['from memory']:.1f} (256 MB) GB per CPU-second",
        flush=True,
    )
    table = [
        "| preset | engine | tokens/CPU-s | GFLOP/CPU-s | of peak "
        "| native speed-up (cpu) | (wall) |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset in args.presets:
        table += bench_preset(preset, prompts, tok, args.repeats, peak, bandwidths, args.arch)
    print("\n".join(table))
    print(
        "\n| engine (rows stop early) | tokens | decode steps | compactions | cpu s | wall s "
        "| tokens/CPU-s |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(bench_compaction(prompts, tok, args.repeats, args.arch)))


if __name__ == "__main__":
    main()
