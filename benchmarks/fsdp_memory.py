"""Per-worker bytes of parameters + gradients + AdamW state under trainer.strategy=fsdp2 (issue 32).

    PYTHONPATH=src .venv/bin/python benchmarks/fsdp_memory.py [--workers 1 2 4] [--layers 12] [--hidden 768]
    PYTHONPATH=src .venv/bin/python benchmarks/fsdp_memory.py --cap-mib 1536 --workers 1 4 [--hidden 768]

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

--cap-mib (goal: the largest model that fits under a fixed per-worker memory cap at W = 4 is
>= 3x the one at W = 1): the same step (forward/backward, AdamW step; no weight sync) at
--hidden, searching the layer count for each W. A model fits when every worker's peak
resident set (`VmHWM`: the process's whole memory, Python, torch and gloo included) stays
<= the cap; the cap is enforced: a thread in each worker ends it once its resident set passes
the cap (`watch_cap`), so no probe holds much more. The search starts where the worker's resident set at
start plus 16 bytes per parameter / W meets the cap (`guess_count`), brackets the
answer by galloping and bisects (`largest_count`): the reported count fits and one more layer does not.
Workers run with glibc's mmap threshold fixed at 64 KiB (`WORKER_ENV`), so freed tensors leave
the resident set and the peak is the live memory's, not the heap's high water.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc's mmap threshold fixed: every tensor above 64 KiB is its own mapping, returned when freed."""
OVER_CAP = 3
"""Exit code of a worker whose resident set passed the cap (`watch_cap`)."""


def rss_mib(field: str) -> float:
    """This process's `VmRSS` (now) or `VmHWM` (peak) from /proc/self/status, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


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


def watch_cap(cap_mib: float, every_s: float = 0.002) -> None:
    """Exit this process (code OVER_CAP) as soon as its resident set passes `cap_mib`: a
    thread polling /proc/self/status, so no probe holds much more than the cap."""

    def watch() -> None:
        while rss_mib("VmRSS") <= cap_mib:
            time.sleep(every_s)
        os._exit(OVER_CAP)

    threading.Thread(target=watch, daemon=True).start()


def worker(rank: int, world: int, port: int, cfg_kwargs: dict, out: str, cap_mib: float | None = None) -> None:
    """One step (module doc) on rank `rank` of `world`; with `cap_mib`, under that cap
    (`watch_cap`) and without the weight sync."""
    import torch.distributed as dist

    from posttrain.distributed.fsdp import training_bytes

    if cap_mib is not None:
        watch_cap(cap_mib)
    torch.set_num_threads(1)
    if world > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    start_mib = rss_mib("VmRSS")  # Python, torch and the group, before any model
    model = build(cfg_kwargs, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg_kwargs["vocab_size"], (2, 32))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    got = training_bytes(model, opt)
    n_params = sum(p.numel() for p in model.parameters())
    peak_mib = rss_mib("VmHWM")
    sync_s = 0.0
    if world > 1 and cap_mib is None:  # a colocated engine's weight sync: every parameter gathered in turn into a plain copy
        from posttrain.distributed.fsdp import stream_full
        from posttrain.models import BuiltinConfig, BuiltinLM

        engine = BuiltinLM(BuiltinConfig(**cfg_kwargs))
        start = time.perf_counter()
        stream_full(model, engine)
        sync_s = time.perf_counter() - start
    with open(f"{out}.{rank}", "w") as f:
        json.dump({**got, "total": sum(got.values()), "parameters": n_params, "sync_s": sync_s,
                   "start_mib": start_mib, "peak_mib": peak_mib}, f)
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, cfg_kwargs: dict, tmp: str, cap_mib: float | None = None) -> list[dict] | None:
    """Each rank's figures (`worker`), or None when a worker passed `cap_mib` (then the rest are ended)."""
    out = os.path.join(tmp, f"w{world}")
    try:
        mp.start_processes(worker, args=(world, free_port(), cfg_kwargs, out, cap_mib), nprocs=world,
                           start_method="spawn")
    except mp.ProcessExitedException as err:
        if err.exit_code == OVER_CAP:
            return None
        raise
    return [json.load(open(f"{out}.{r}")) for r in range(world)]


def parameter_count(cfg_kwargs: dict) -> int:
    """Parameters of the built-in decoder of `cfg_kwargs` (a tied head counted once)."""
    from posttrain.models import BuiltinConfig, BuiltinLM

    with torch.device("meta"):
        return BuiltinLM(BuiltinConfig(**cfg_kwargs)).num_parameters()


def largest_count(fits: Callable[[int], bool], guess: int) -> int:
    """The largest count L >= 1 with fits(L) (0 if not fits(1)), for a `fits` that holds up to
    some count and fails beyond: galloping from `guess` (steps 1, 2, 4, ... up while it fits,
    down while it does not) until the answer is bracketed, then bisection."""
    if not fits(1):
        return 0
    count, step = max(guess, 1), 1
    if fits(count):
        good, bad = count, count + 1
        while fits(bad):
            good, bad, step = bad, bad + 2 * step, 2 * step
    else:
        good, bad = max(1, count - 1), count
        while not fits(good):
            good, bad, step = max(1, good - 2 * step), good, 2 * step
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def guess_count(start_mib: float, root_parameters: int, layer_parameters: int, world: int, cap: float) -> int:
    """The layer count whose training state alone (16 bytes per parameter over W workers:
    weights, gradients, two AdamW moments) on top of a worker's resident set at start meets
    `cap` (MiB): a start for `largest_count`. It leaves out the step's transients (a gathered
    layer and root, AdamW's temporaries), so it is a little high."""
    per_worker = (cap - start_mib) * 2**20 * world / 16  # parameters the cap holds as training state
    return max(1, int((per_worker - root_parameters) / layer_parameters))


def fit_under_cap(world: int, cap_mib: float, cfg_kwargs: dict, tmp: str) -> dict:
    """The largest layer count whose step keeps every worker under `cap_mib` (module doc), with
    each probe: parameters, max worker peak MiB (None: a worker passed the cap), max start MiB."""
    probes: dict[int, dict] = {}

    def fits(layers: int) -> bool:
        if layers not in probes:
            ranks = measure(world, {**cfg_kwargs, "num_hidden_layers": layers}, tmp, cap_mib)
            probes[layers] = {"parameters": parameter_count({**cfg_kwargs, "num_hidden_layers": layers}),
                              "peak_mib": max(r["peak_mib"] for r in ranks) if ranks else None,
                              "start_mib": max(r["start_mib"] for r in ranks) if ranks else None}
            peak = probes[layers]["peak_mib"]
            print(f"  W={world} layers={layers}: peak {'> cap' if peak is None else f'{peak:.0f}'} MiB", flush=True)
        peak = probes[layers]["peak_mib"]
        return peak is not None and peak <= cap_mib

    one, two = (parameter_count({**cfg_kwargs, "num_hidden_layers": n}) for n in (1, 2))
    guess = guess_count(probes[1]["start_mib"], one - (two - one), two - one, world, cap_mib) if fits(1) else 1
    layers = largest_count(fits, guess)
    return {"world": world, "layers": layers, "parameters": probes[layers]["parameters"] if layers else 0,
            "probes": probes}


def main(argv: list[str] | None = None) -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--cap-mib", type=float, help="per-worker peak-RSS cap: find the largest model under it")
    args = ap.parse_args(argv)
    h = args.hidden
    cfg_kwargs = dict(vocab_size=args.vocab, hidden_size=h, intermediate_size=(8 * h // 3 + 63) // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, h // 64))
    with tempfile.TemporaryDirectory() as tmp:
        if args.cap_mib is not None:
            print_fits(args.workers, args.cap_mib, cfg_kwargs, tmp)
        else:
            print_bytes(args.workers, cfg_kwargs, tmp)


def print_bytes(workers: list[int], cfg_kwargs: dict, tmp: str) -> None:
    print("| W | worker | params MB | grads MB | optimizer MB | total MB | total / (one worker / W) | overhead MB "
          "| weight sync s |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for w in sorted(workers):
        ranks = measure(w, cfg_kwargs, tmp)
        if base is None:  # the one-worker figure (from the smallest W)
            base = ranks[0]["total"] * w
            print(f"model: {parameter_count(cfg_kwargs):,} parameters", flush=True)
        for r, x in enumerate(ranks):
            mb = {k: x[k] / 2**20 for k in ("params", "grads", "optimizer", "total")}
            print(f"| {w} | {r} | {mb['params']:.1f} | {mb['grads']:.1f} | {mb['optimizer']:.1f} | "
                  f"{mb['total']:.1f} | {x['total'] / (base / w):.3f} | {(x['total'] - base / w) / 2**20:.3f} | "
                  f"{x['sync_s']:.2f} |", flush=True)


def print_fits(workers: list[int], cap_mib: float, cfg_kwargs: dict, tmp: str) -> None:
    os.environ.update(WORKER_ENV)  # read by each spawned worker's glibc at start
    fits = [fit_under_cap(w, cap_mib, cfg_kwargs, tmp) for w in sorted(workers)]
    print(f"\nper-worker cap {cap_mib:.0f} MiB peak RSS (VmHWM), hidden {cfg_kwargs['hidden_size']}, "
          f"vocab {cfg_kwargs['vocab_size']}")
    print("| W | largest fitting layers L | parameters | ÷ W = 1 | peak MiB at L (max worker) | at L + 1 "
          "| worker at start MiB | peak at 1 layer | MiB per layer (two largest fitting counts) |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = fits[0]["parameters"]
    for f in fits:
        p, n = f["probes"], f["layers"]
        if not n:
            print(f"| {f['world']} | 0 | – | – | – | > cap at 1 layer | – | – | – |")
            continue
        nxt = p[n + 1]["peak_mib"]
        # from the two largest counts that fit: near the cap the peak is the AdamW step's (all the
        # training state), at 1 layer it can be the backward's (a gathered root and its gradient)
        fitting = sorted(k for k, v in p.items() if v["peak_mib"] is not None and v["peak_mib"] <= cap_mib)
        a, b = fitting[-2:] if len(fitting) > 1 else (n, n)
        slope = f"{(p[b]['peak_mib'] - p[a]['peak_mib']) / (b - a):.1f}" if b > a else "–"
        print(f"| {f['world']} | {n} | {f['parameters']:,} | **{f['parameters'] / max(base, 1):.2f}x** | "
              f"{p[n]['peak_mib']:.0f} | {'> cap' if nxt is None else f'{nxt:.0f}'} | {p[n]['start_mib']:.0f} | "
              f"{p[1]['peak_mib']:.0f} | {slope} |", flush=True)
    print(json.dumps(fits))


if __name__ == "__main__":
    main()
