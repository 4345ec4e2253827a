"""What partial rollouts cost (issue 34): a training batch generated in one call against the same
batch in segments of S tokens (trainer.async_training.partial_rollout_tokens), the same weights,
side by side in one process, single-turn responses or multi-turn episodes alike.

    PYTHONPATH=src .venv/bin/python benchmarks/partial_rollout.py --config recipes/grpo_tools.yaml \
        --tokens 64 16 4 --batches 3 model.path=runs/sft_tools/final data.train_files=[data/tools/train.jsonl]

Each segment prefills every unfinished row's prompt + tokens so far again (no KV cache is kept
across a possible weight change: `trainers/rl_partial.py`), so the cost grows as S shrinks; a
segment that ends no row's generation early costs only that prefill. Per S: the median seconds
over the batches (after an untimed warm-up call, each batch timed whole, then in segments, --repeats
times), the
ratio to the whole call, the segments per batch, and whether the segments gave the whole call's
tokens (rollout.seed_mode=row and unchanged weights: they must, up to float rounding of the
log-probs). The run's config overrides follow the flags (key=value, as on the CLI).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.config import build_config


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def in_segments(partial, prompts, step):
    """The batch generated segment by segment with unchanged weights (version 0): (batch, segments)."""
    part, segments = partial.start(prompts, step, 0), 1
    while not part.finished:
        part, segments = partial.resume(part, 0), segments + 1
    return partial.complete(part), segments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 16, 4])
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(GRPOConfig, args.config, [
            *args.overrides, "rollout.seed_mode=row", "trainer.async_training.max_staleness=1",
            "trainer.async_training.partial_rollout=true", "trainer.report_to=[]", "trainer.progress=false",
            f"trainer.output_dir={tmp}"])
        trainer = GRPOTrainer(args=cfg)
        partial, rollout = trainer.pipeline.partial, trainer.roles.rollout
        size = cfg.data.train_batch_size
        times: dict[str | int, list[float]] = {"whole": [], **{s: [] for s in args.tokens}}
        segments: dict[int, list[int]] = {s: [] for s in args.tokens}
        same: dict[int, bool] = dict.fromkeys(args.tokens, True)
        tokens = 0
        rollout.generate(trainer.prompts_of(list(range(size))), 0)  # warm-up, untimed
        for b in range(args.batches):
            prompts = trainer.prompts_of(list(range(b * size, (b + 1) * size))).replace(uid=torch.arange(size))
            for _ in range(args.repeats):
                whole, seconds = timed(rollout.generate, prompts, partial.seed_of(b + 1))
                times["whole"].append(seconds)
                tokens += int(whole.lengths.sum())
                for s in args.tokens:
                    partial.tokens = s
                    (out, count), seconds = timed(in_segments, partial, prompts, b + 1)
                    times[s].append(seconds)
                    segments[s].append(count)
                    same[s] &= torch.equal(out.response_ids, whole.response_ids)
        trainer.roles.close()
    base = statistics.median(times["whole"])
    rows = [{"S": "whole", "seconds": base, "ratio": 1.0, "segments": 1, "same_tokens": True}]
    rows += [{"S": s, "seconds": statistics.median(times[s]), "ratio": statistics.median(times[s]) / base,
              "segments": statistics.median(segments[s]), "same_tokens": same[s]} for s in args.tokens]
    episodes = cfg.rollout.episodes
    print(f"{'episodes' if episodes else 'single-turn'}: {size} prompts x {cfg.rollout.n}, "
          f"{tokens / (args.batches * args.repeats):.0f} model tokens per batch, {args.threads} thread(s)")
    print("| S | seconds per batch | x whole | segments | same tokens |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['S']} | {r['seconds']:.2f} | {r['ratio']:.2f} | {r['segments']:g} | {r['same_tokens']} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                        "config": args.config, "overrides": args.overrides, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
