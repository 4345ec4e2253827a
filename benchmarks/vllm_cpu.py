"""vLLM's CPU build against the native engine and transformers' generate: tokens/s, start-up
time and weight-sync time per step, on the `small` preset and a ~100M-parameter Llama folder
(built here from a config, random init: nothing is downloaded).

    PYTHONPATH=src VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_cpu.py \
        [--models small llama100m] [--rows 64] [--tokens 128] [--repeats 1] [--dtypes float32 bfloat16]
        [--engines native hf vllm]

Workload (every engine, same weights and prompts): 8 arithmetic-task prompts × 8 samples = 64
rows, 128 new tokens per row with early stopping off (`stop_token_ids=[]`), temperature 1,
log-probs returned (the engines' own; hf recomputes them by teacher forcing). Over the byte
tokenizer (V = 262). Needs vLLM (`make test-vllm` builds .venv-vllm with its CPU build).

Reported per engine: generated tokens per wall-clock second (median over --repeats, after a
short warm-up call), start-up (building the engine over a model in memory: vLLM saves it and loads
it, eager, no compile; hf loads the folder), and weight sync per step (`sync_weights` of the
policy after an "update"; native and hf share the policy's tensors: 0). Wall clock, on a
machine that may be shared: see benchmarks/README.md for the recorded load.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain.data.tasks import get_task
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM
from posttrain.rollout import SamplingParams, make_engine

LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12,
                  num_key_value_heads=12, max_position_embeddings=2048)
"""99.3M parameters at V = 262: 14 × (4·768² + 3·768·2048) + 262·768 (tied)."""


def build_folder(name: str, tok, root: Path) -> Path:
    """A Llama checkpoint folder (config.json, safetensors, tokenizer) of model `name`: a preset
    of the built-in model, or LLAMA_100M built by transformers from a LlamaConfig."""
    path = root / name
    torch.manual_seed(0)
    if name == "llama100m":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **LLAMA_100M)
        LlamaForCausalLM(cfg).save_pretrained(path)
    else:
        BuiltinLM.from_preset(name, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def tokens_per_s(engine, prompts, params, repeats: int) -> float:
    engine.generate(prompts[:2], SamplingParams(**{**params.__dict__, "max_new_tokens": 8}))  # warm-up
    rates = []
    for r in range(repeats):
        out, s = timed(lambda r=r: engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": r})))
        rates.append(int(out.lengths.sum()) / s)
    return statistics.median(rates)


def perturb(model) -> None:
    """An "update": every weight moves a little."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)


def bench_model(name: str, args, tok, root: Path) -> list[dict]:
    from transformers import LlamaForCausalLM

    from posttrain.models.loading import load_causal_lm

    folder = build_folder(name, tok, root)
    policy = load_causal_lm(str(folder), impl="builtin").eval()
    n_params = sum(p.numel() for p in policy.parameters())
    prompts = [r["prompt"] for r in get_task("arithmetic").generate(args.rows // 8, random.Random(0))]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=args.tokens, stop_token_ids=[], seed=0)
    rows = []

    def record(row: dict) -> None:  # printed as each engine finishes: a run stopped early keeps its rows
        row.update(model=name, parameters=n_params)
        print(json.dumps(row), flush=True)
        rows.append(row)

    for kind in args.engines:
        if kind == "native":
            native, start = timed(lambda: make_engine("native", policy, tok))
            record({"engine": "native", "dtype": "float32", "start_s": start,
                    "tokens_per_s": tokens_per_s(native, prompts, params, args.repeats), "sync_s": 0.0})
        elif kind == "hf":
            hf_model, start = timed(lambda: LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
            hf = make_engine("hf", hf_model, tok)
            record({"engine": "hf generate", "dtype": "float32", "start_s": start,
                    "tokens_per_s": tokens_per_s(hf, prompts, params, args.repeats), "sync_s": 0.0})
            del hf, hf_model
        else:
            for dtype in args.dtypes:
                engine, start = timed(lambda dtype=dtype: make_engine(
                    "vllm", policy, tok, dtype=dtype, enforce_eager=True, max_model_len=512))
                rate = tokens_per_s(engine, prompts, params, args.repeats)
                syncs = []
                for _ in range(3):
                    perturb(policy)
                    syncs.append(timed(lambda engine=engine: engine.sync_weights(policy))[1])
                record({"engine": "vllm-cpu (eager)", "dtype": dtype, "start_s": start, "tokens_per_s": rate,
                        "sync_s": statistics.median(syncs)})
                del engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["small", "llama100m"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--engines", nargs="+", choices=["native", "hf", "vllm"], default=["native", "hf", "vllm"],
                    help="which engines, in this order (the first vLLM engine's start includes importing vLLM)")
    args = ap.parse_args()
    tok = build_tokenizer()
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-vllm-") as root:
        rows = [r for m in args.models for r in bench_model(m, args, tok, Path(root))]
    print("| model | parameters | engine | dtype | tokens/s | start-up (s) | weight sync per step (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['engine']} | {r['dtype']} | "
              f"{r['tokens_per_s']:.0f} | {r['start_s']:.1f} | {r['sync_s']:.2f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
