"""Per-worker bytes of parameters + gradients + AdamW state under trainer.strategy=fsdp2 (issue 32).

    PYTHONPATH=src .venv/bin/python benchmarks/fsdp_memory.py [--workers 1 2 4] [--layers 12] [--hidden 768]

A built-in decoder of >= 100M parameters (random init, fp32, built from its config: hidden
--hidden, --layers layers, vocab --vocab, SwiGLU width 8/3 H, tied head) is sharded as the RL
workers shard the actor (`distributed.fsdp.shard_model`: fully_shard per decoder layer, then
the root) over W gloo processes on this machine (127.0.0.1); W=1 is the plain model in one
process, no group. Each worker runs one forward/backward on a 2 x 32-token batch and one
AdamW step, then reports the bytes it holds, read from the actual tensors' local sizes
(`DTensor.to_local()`; `fsdp.training_bytes`) before the gradients are dropped: parameters,
gradients, optimizer state. The model is built on the meta device and materialised after
sharding, so no worker ever holds the whole model.

Goal: worker bytes(W) <= 1.15 / W x bytes(1) + fixed overhead. The fixed overhead here is
AdamW's `step` counters (one scalar tensor per parameter, replicated) and the dim-0 rounding
of shards: it is printed as bytes(W) - bytes(1) / W.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.multiprocessing as mp


def build(cfg_kwargs: dict, world: int):
    from posttrain.distributed.fsdp import shard_model
    from posttrain.models import BuiltinConfig, BuiltinLM

    torch.manual_seed(0)
    if world == 1:
        return BuiltinLM(BuiltinConfig(**cfg_kwargs))
    with torch.device("meta"):
        model = BuiltinLM(BuiltinConfig(**cfg_kwargs))
    shard_model(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        small = dict(BuiltinLM(BuiltinConfig(**{**cfg_kwargs, "num_hidden_layers": 1, "vocab_size": 8})).named_buffers())
        for name, b in model.named_buffers():  # the rotary table, from a 1-layer model of the same config
            b.copy_(small[name])
    return model


def worker(rank: int, world: int, port: int, cfg_kwargs: dict, out: str) -> None:
    import torch.distributed as dist

    from posttrain.distributed.fsdp import training_bytes

    torch.set_num_threads(1)
    if world > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build(cfg_kwargs, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg_kwargs["vocab_size"], (2, 32))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    got = training_bytes(model, opt)
    n_params = sum(p.numel() for p in model.parameters())
    sync_s = 0.0
    if world > 1:  # a colocated engine's weight sync: every parameter gathered in turn into a plain copy
        from posttrain.distributed.fsdp import stream_full
        from posttrain.models import BuiltinConfig, BuiltinLM

        engine = BuiltinLM(BuiltinConfig(**cfg_kwargs))
        start = time.perf_counter()
        stream_full(model, engine)
        sync_s = time.perf_counter() - start
    with open(f"{out}.{rank}", "w") as f:
        json.dump({**got, "total": sum(got.values()), "parameters": n_params, "sync_s": sync_s}, f)
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, cfg_kwargs: dict, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"w{world}")
    mp.start_processes(worker, args=(world, free_port(), cfg_kwargs, out), nprocs=world, start_method="spawn")
    return [json.load(open(f"{out}.{r}")) for r in range(world)]


def main(argv: list[str] | None = None) -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    h = args.hidden
    cfg_kwargs = dict(vocab_size=args.vocab, hidden_size=h, intermediate_size=(8 * h // 3 + 63) // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, h // 64))
    print("| W | worker | params MB | grads MB | optimizer MB | total MB | total / (one worker / W) | overhead MB "
          "| weight sync s |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for w in sorted(args.workers):
            ranks = measure(w, cfg_kwargs, tmp)
            if base is None:  # the one-worker figure (from the smallest W)
                base = ranks[0]["total"] * w
                print(f"model: {ranks[0]['parameters'] * w:,} parameters", flush=True)
            for r, x in enumerate(ranks):
                mb = {k: x[k] / 2**20 for k in ("params", "grads", "optimizer", "total")}
                print(f"| {w} | {r} | {mb['params']:.1f} | {mb['grads']:.1f} | {mb['optimizer']:.1f} | "
                      f"{mb['total']:.1f} | {x['total'] / (base / w):.3f} | {(x['total'] - base / w) / 2**20:.3f} | "
                      f"{x['sync_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
