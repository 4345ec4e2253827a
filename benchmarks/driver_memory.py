"""The RL driver's peak RSS on a Ray run, by model size (issue 32 item 2: it must not grow with the model).

    PYTHONPATH=src .venv/bin/python benchmarks/driver_memory.py --out runs/bench_driver [--models tiny small llama100m]

Each model runs in its own fresh child process, which is the driver: `posttrain grpo` with
`recipes/grpo.yaml` on the bundled arithmetic task, trainer.backend=ray with 2 workers
(placement.cpus_per_worker=1), --steps steps of 2 prompts x 2 completions of 6 tokens, a
checkpoint every step (the HF folders and DCP shards), eval.task every 2 steps on 2 prompts,
and final/. Measured in the child after the run: `resource.getrusage(RUSAGE_SELF).ru_maxrss`,
the driver process's own peak resident set (the Ray workers, raylet and object store are other
processes and not counted), and its RSS when the run was built (before the loop).

Models: `tiny` and `small` (`model.init`, the built-in presets, random weights) and `llama100m`,
a ~100M-parameter `LlamaForCausalLM` folder written here from a config (hidden 768, 14 layers,
MLP 2048, 12 heads, the byte tokenizer; random init, nothing downloaded), loaded by
`model.path`. `--src` runs another checkout's sources (e.g. main's) for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama_folder(folder: Path) -> Path:
    """A random ~100M-parameter Llama checkpoint with the built-in byte tokenizer."""
    import torch
    import transformers

    from posttrain.checkpoint import save_tokenizer
    from posttrain.config.sections import ModelConfig
    from posttrain.models.factory import load_tokenizer

    if (folder / "config.json").is_file():
        return folder
    tok = load_tokenizer(ModelConfig(init="tiny"))
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=768, intermediate_size=2048,
                                   num_hidden_layers=14, num_attention_heads=12, num_key_value_heads=12,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    save_tokenizer(tok, folder)
    return folder


def child(model: str, out: Path, steps: int) -> dict:
    """Run one model's GRPO on Ray in this process; return the driver's figures."""
    from posttrain.cli import main
    from posttrain.data.tasks import make_task

    data = out / "data"
    if not (data / "train.jsonl").is_file():
        make_task("arithmetic", data, n_train=16, n_test=4, seed=0, difficulty="easy")
    source = ["model.path=null", f"model.init={model}"]
    if model == "llama100m":  # the folder was built by another process (`--build-folder`): not in this peak
        source = [f"model.path={out / 'llama100m'}", "model.init=null", "model.impl=builtin"]
    run = out / f"run-{model}"
    started = time.perf_counter()
    code = main(["grpo", "--config", str(ROOT / "recipes" / "grpo.yaml"), *source,
                 f"data.train_files=[{data / 'train.jsonl'}]", f"data.eval_files=[{data / 'test.jsonl'}]",
                 "eval.num_examples=2", "eval.max_new_tokens=6", "trainer.eval_steps=2", "trainer.save_steps=1",
                 "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=6",
                 "actor.micro_batch_size=4", f"trainer.max_steps={steps}", "algorithm.overlong.buffer=0",
                 f"trainer.output_dir={run}", "trainer.report_to=[]", "trainer.progress=false",
                 "trainer.backend=ray", "trainer.nnodes=1", "trainer.n_workers_per_node=2",
                 "placement.cpus_per_worker=1"])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = json.loads((run / "final" / "config.json").read_text())
    weights = sum(p.stat().st_size for p in (run / "final").glob("*.safetensors"))
    return {"model": model, "exit": code, "seconds": round(time.perf_counter() - started, 1),
            "driver_peak_rss_mib": round(peak_kib / 1024, 1), "final_weights_mib": round(weights / 2**20, 1),
            "hidden_size": params.get("hidden_size"), "layers": params.get("num_hidden_layers")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=["tiny", "small", "llama100m"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the sources the driver runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--build-folder", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.build_folder:
        llama_folder(a.out / "llama100m")
        return
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.out, a.steps)), flush=True)
        return
    env = {**os.environ, "PYTHONPATH": str(a.src), "OMP_NUM_THREADS": "1"}
    rows = []
    if "llama100m" in a.models:  # built in a process of its own, so no driver's peak holds the model it built
        subprocess.run([sys.executable, __file__, "--out", str(a.out), "--build-folder"], env=env, check=True)
    for model in a.models:
        proc = subprocess.run([sys.executable, __file__, "--out", str(a.out), "--steps", str(a.steps),
                               "--child", model], env=env, capture_output=True, text=True)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(found[-1][7:]) if found else {"model": model, "error": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (a.out / "driver_memory.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
