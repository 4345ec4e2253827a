"""Training throughput and MFU of the built-in model on this machine (forward + backward).

MFU = achieved model FLOP/s ÷ the fp32 matmul peak measured in the same run
(a large square `torch.mm`, best of several). Model FLOPs per step follow the usual
count (Kaplan et al. 2020; PaLM appendix B):

    6 · N_matmul · tokens                 (weights: 2 forward + 4 backward per parameter)
  + 12 · L · T · H · tokens · (causal: ½)  (attention scores and values, fwd + bwd)

where N_matmul counts the parameters used in matmuls (embedding lookup excluded; the
tied output projection included), L layers, T sequence length, H hidden size.

    python benchmarks/train_throughput.py [--hidden 512 --layers 8 --seq 512 --batch 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from posttrain.models import BuiltinLM
from posttrain.models.builtin import BuiltinConfig


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """Best fp32 GFLOP/s of an n×n×n matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def model_flops(cfg: BuiltinConfig, batch: int, seq: int) -> float:
    """Training FLOPs of one forward + backward over batch × seq tokens (see module doc)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (cfg.num_attention_heads * cfg.head_dim) * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size
    n_matmul = layers * per_layer + h * cfg.vocab_size
    tokens = batch * seq
    attention = 12 * layers * seq * h * tokens * 0.5
    return 6 * n_matmul * tokens + attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=262)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    torch.manual_seed(0)
    model = BuiltinLM.from_preset(
        "small", vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads,
        intermediate_size=int(8 * args.hidden / 3 / 64 + 1) * 64, max_position_embeddings=args.seq,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step() -> float:
        t0 = time.perf_counter()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        fb = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return fb

    peak_before = matmul_peak()
    step()  # warm-up
    times = [step() for _ in range(args.steps)]
    peak_after = matmul_peak()
    peak = max(peak_before, peak_after)
    best = min(times)
    flops = model_flops(model.config, args.batch, args.seq)
    result = {
        "params": model.num_parameters(),
        "tokens_per_step": args.batch * args.seq,
        "fwd_bwd_s_best": round(best, 3),
        "fwd_bwd_s_median": round(sorted(times)[len(times) // 2], 3),
        "tokens_per_s": round(args.batch * args.seq / best, 1),
        "model_gflop_per_s": round(flops / best / 1e9, 1),
        "matmul_peak_gflop_per_s": round(peak, 1),
        "mfu": round(flops / best / 1e9 / peak, 3),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
