"""Peak extra memory of per-token log-probs and entropies, chunked vs naive.

    python benchmarks/logprob_memory.py [--batch 8 --tokens 1024 --vocab 32000]

Compares `posttrain.algos.token_logprobs` / `entropy_from_logits` with the
naive `log_softmax(logits.float()).gather(...)` (and a naive unchunked
entropy) on random logits of shape (B, T, V), bf16 and fp32, on the CPU.

How memory is measured: every (function, dtype) runs in a fresh Python
process. The process builds its logits and labels (row block by row block, so
building them has no larger transient), then resets the kernel's resident-set
high-water mark (`echo 5 > /proc/self/clear_refs`) and records its resident
set. It then runs the function and reads the high-water mark back
(`VmHWM` in /proc/self/status). Extra peak = VmHWM − resident set before the
call: every byte the call touched at its peak, including allocator slack and
temporaries inside ATen kernels, which an allocation-tracking profiler sees
only partly. PyTorch's CPU allocator does not cache, so freed blocks go back to
malloc; a fresh process per measurement keeps one run's heap from hiding
another's, and a fixed glibc mmap threshold makes every large block go back
to the kernel when freed, so the resident set follows live memory. Linux only.

Per function three numbers: the forward under `torch.no_grad()` (how old,
reference and rollout log-probs are computed), the forward with
`logits.requires_grad` (the graph it keeps alive is included), and forward +
backward of `.sum()` (includes the (B, T, V) gradient buffer in the logits'
dtype, which any method must allocate).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

from posttrain.algos import entropy_from_logits, token_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _naive_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _naive_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


VARIANTS = {
    "naive log_softmax(logits.float()).gather": _naive_logprobs,
    "token_logprobs": token_logprobs,
    "naive entropy (unchunked)": _naive_entropy,
    "entropy_from_logits": lambda logits, labels: entropy_from_logits(logits),
}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _peak_extra_mib(before_kib: int) -> float:
    return (_status_kib("VmHWM") - before_kib) / 1024


def _child(variant: str, dtype: str, batch: int, tokens: int, vocab: int) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(batch, tokens, vocab, dtype=DTYPES[dtype])
    for row in logits.view(-1, tokens, vocab):
        row.copy_(torch.randn(tokens, vocab, generator=gen) * 3)
    labels = torch.randint(0, vocab, (batch, tokens), generator=gen)
    fn = VARIANTS[variant]
    result = {"logits_mib": logits.numel() * logits.element_size() / 2**20}

    before = _reset_peak()
    start = time.perf_counter()
    with torch.no_grad():
        out = fn(logits, labels)
    result["no_grad_mib"] = _peak_extra_mib(before)
    result["no_grad_s"] = time.perf_counter() - start
    del out

    logits.requires_grad_()
    before = _reset_peak()
    out = fn(logits, labels)
    result["grad_fwd_mib"] = _peak_extra_mib(before)
    out.sum().backward()
    result["grad_fwd_bwd_mib"] = _peak_extra_mib(before)
    return result


def _measure(variant: str, dtype: str, args: argparse.Namespace) -> dict:
    sizes = f"--batch={args.batch} --tokens={args.tokens} --vocab={args.vocab}".split()
    command = [sys.executable, __file__, "--child", variant, dtype, *sizes]
    # A fixed mmap threshold: every block of 128 KiB or more is mapped on malloc
    # and unmapped on free, so the resident set follows live memory instead of
    # glibc's heap keeping (and silently reusing) freed blocks.
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child, args.batch, args.tokens, args.vocab)))
        return

    print(f"B={args.batch} T={args.tokens} V={args.vocab}, torch {torch.__version__}, 1 thread")
    columns = ["logits", "function", "forward, no_grad", "forward, grad", "forward + backward"]
    print("| " + " | ".join([*columns, "no_grad time"]) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for dtype in args.dtypes:
        naive = None
        for variant in VARIANTS:
            r = _measure(variant, dtype, args)
            naive = naive or r
            share = 100 * r["no_grad_mib"] / naive["no_grad_mib"]
            print(
                f"| {dtype} ({r['logits_mib']:.0f} MiB) | {variant} "
                f"| {r['no_grad_mib']:.0f} MiB ({share:.0f}%) | {r['grad_fwd_mib']:.0f} MiB "
                f"| {r['grad_fwd_bwd_mib']:.0f} MiB | {r['no_grad_s']:.2f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
