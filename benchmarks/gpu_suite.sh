#!/usr/bin/env bash
# The checks only a CUDA machine can run (one GPU, under 8 minutes), one PASS/FAIL/SKIP line each;
# exits non-zero if any check fails. From the repository root:
#
#     bash benchmarks/gpu_suite.sh            # PYTHON=.venv/bin/python to choose the interpreter
#
# Checks: CUDA is visible; NCCL initialises (one process, world size 1); a few SFT steps of the
# built-in tiny model on CUDA under bf16 autocast keep fp32 master weights and a finite loss, in one
# process and under torchrun with trainer.strategy=fsdp2 (NCCL, sharded DCP checkpoint); the
# native engine generates on CUDA as it does on the CPU; a colocated Ray GRPO run of 20 steps
# (trainer.backend=ray, 2 workers sharing the GPU, generation split over them); FSDP2 inside the Ray workers
# (trainer.strategy=fsdp2: an NCCL worker with bf16 compute over fp32 shards, with trainer.fsdp.param_offload,
# then with trainer.fsdp.optimizer_offload; tests/trainers/test_rl_fsdp_gpu.py); the vllm engine's tests
# (marker `vllm`: tests/rollout/test_rollout_vllm.py: single-turn sampling, weight sync, sleep, LoRA,
# multi-turn episodes over the calculator environment; tests/trainers/test_rl_vllm.py: GRPO, 2 Ray
# workers) under vLLM's CUDA build when vLLM is importable: what `make test-vllm` runs on the CPU build,
# here with the CUDA kernels, sleep mode and `load_weights`. A missing vLLM is a SKIP, not a
# failure; POSTTRAIN_INSTALL_VLLM=1 first tries `pip install 'posttrain[vllm]'` (needs a registry).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
WORK="$(mktemp -d -t posttrain-gpu-suite.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
failed=0

# check NAME SECONDS COMMAND...: run COMMAND under a time limit, print one line for it.
check() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "PASS $name ($(($(date +%s) - start)) s): $(tail -n 1 "$WORK/$name.log")"
    else
        failed=1
        echo "FAIL $name (rc $rc, $(($(date +%s) - start)) s); last lines:"
        tail -n 15 "$WORK/$name.log" | sed 's/^/    /'
    fi
}

check cuda 60 "$PY" -c '
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'

check nccl 120 "$PY" -c '
import torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
x = torch.ones(4, device="cuda")
dist.all_reduce(x)
assert x.tolist() == [1.0] * 4, x
print("nccl", torch.cuda.nccl.version(), "all_reduce over 1 rank ok")
dist.destroy_process_group()'

check sft_bf16_autocast 240 "$PY" -c '
import json, math, sys
from pathlib import Path
import torch
from posttrain import SFTConfig, SFTTrainer
from posttrain.config import build_config
from posttrain.data.tasks import make_task
work = Path(sys.argv[1])
data, run = work / "arith", work / "sft"
make_task("arithmetic", data, n_train=64, n_test=8, seed=0, difficulty="easy")
cfg = build_config(SFTConfig, None, [
    "model.init=tiny", "model.device=cuda", "trainer.precision=bf16", "trainer.max_steps=5",
    f"data.train_files=[{data}/train.jsonl]", "data.train_batch_size=8", "trainer.micro_batch_size=4",
    f"trainer.output_dir={run}", "trainer.report_to=[]", "trainer.progress=false"])
trainer = SFTTrainer(args=cfg)
trainer.train()
dtypes = {p.dtype for p in trainer.model.parameters()}
assert dtypes == {torch.float32}, f"master weights are {dtypes}, not float32"
assert next(trainer.model.parameters()).is_cuda, "the model is not on CUDA"
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
losses = [r["loss"] for r in rows if "loss" in r]
assert losses and all(math.isfinite(x) for x in losses), losses
print(f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, weights float32 on cuda")' "$WORK"

check fsdp2_bf16_autocast 300 "$PY" -c '
import json, math, os, subprocess, sys
from pathlib import Path
from safetensors import safe_open
from posttrain.data.tasks import make_task
work = Path(sys.argv[1])
data, run = work / "arith_fsdp", work / "sft_fsdp2"
make_task("arithmetic", data, n_train=64, n_test=8, seed=0, difficulty="easy")
cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29534",
       "-m", "posttrain", "sft", "model.init=tiny", "model.device=cuda", "trainer.precision=bf16",
       "trainer.strategy=fsdp2", "trainer.max_steps=5", f"data.train_files=[{data}/train.jsonl]",
       "data.train_batch_size=8", "trainer.micro_batch_size=4", f"trainer.output_dir={run}",
       "trainer.report_to=[]", "trainer.progress=false", "trainer.save_steps=5"]
subprocess.run(cmd, check=True, env=os.environ)
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
losses = [r["loss"] for r in rows if "loss" in r]
assert losses and all(math.isfinite(x) for x in losses), losses
with safe_open(str(run / "final" / "model.safetensors"), "pt") as f:
    dtypes = {str(f.get_tensor(k).dtype) for k in f.keys()}
assert dtypes == {"torch.float32"}, f"the FSDP2 master weights were saved as {dtypes}"
assert (run / "checkpoints" / "step-5" / "dcp").is_dir(), "no DCP shards in the checkpoint"
print(f"torchrun fsdp2 on cuda: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, fp32 master weights, dcp shards")' "$WORK"

check native_engine_cuda 180 "$PY" -c '
import sys
sys.path.insert(0, "tests")
import torch
from rollout.conftest import PROMPTS, randomized
from posttrain.data.tokenizer import build_tokenizer
from posttrain.rollout import SamplingParams, make_engine
tok = build_tokenizer()
params = SamplingParams(n=2, temperature=0, max_new_tokens=16, stop_token_ids=[])
cpu = make_engine("native", randomized(seed=3), tok).generate(PROMPTS, params)
gpu = make_engine("native", randomized(seed=3).cuda(), tok).generate(PROMPTS, params)
assert torch.equal(gpu.response_ids.cpu(), cpu.response_ids), "greedy tokens differ from the CPU"
diff = (gpu.logprobs.cpu() - cpu.logprobs).abs().max().item()
assert diff < 1e-3, f"logprobs differ from the CPU by {diff}"
sampled = make_engine("native", randomized(seed=3).cuda(), tok).generate(
    PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=0))
assert torch.equal(sampled.response_mask.sum(-1).cpu(), sampled.lengths.cpu())
print(f"greedy equals the CPU, logprob diff {diff:.1e}; {len(sampled.lengths)} sampled rows")'

check ray_fsdp2_bf16_offload 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/trainers/test_rl_fsdp_gpu.py

check ray_grpo_cuda 240 "$PY" -c '
import json, math, sys
from pathlib import Path
from posttrain.cli import main
from posttrain.data.tasks import make_task
work = Path(sys.argv[1])
data, run = work / "arith_ray", work / "grpo_ray"
make_task("arithmetic", data, n_train=64, n_test=4, seed=0, difficulty="easy")
rc = main(["grpo", "--config", "recipes/grpo.yaml", "model.path=null", "model.init=tiny", "model.device=cuda",
           f"data.train_files=[{data}/train.jsonl]", f"data.eval_files=[{data}/test.jsonl]", "eval.num_examples=2",
           "data.train_batch_size=8", "rollout.n=4", "rollout.max_new_tokens=16", "actor.micro_batch_size=16",
           "trainer.max_steps=20", "trainer.save_steps=10", "trainer.eval_steps=0", "trainer.report_to=[]",
           "trainer.progress=false", f"trainer.output_dir={run}", "trainer.backend=ray", "trainer.n_workers_per_node=2",
           "placement.gpus_per_worker=0.5", "rollout.seed_mode=row"])
assert rc == 0, f"exit code {rc}"
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
steps = [r for r in rows if "timing/step" in r]
assert len(steps) == 20 and all(math.isfinite(r["grad_norm"]) for r in steps), steps[-1]
assert (run / "final" / "config.json").is_file() and (run / "checkpoints" / "step-20").is_dir()
mean = sum(r["timing/step"] for r in steps) / len(steps)
first, last = steps[0]["reward/mean"], steps[-1]["reward/mean"]
print(f"20 colocated steps on 2 GPU workers (0.5 GPU each, split generation): {mean:.2f} s/step, "
      f"reward {first:.2f} -> {last:.2f}")' "$WORK"

if ! "$PY" -c 'import vllm' >/dev/null 2>&1 && [ "${POSTTRAIN_INSTALL_VLLM:-0}" = 1 ]; then
    timeout 300 "$PY" -m pip install -q -e '.[vllm]' >"$WORK/pip.log" 2>&1 ||
        echo "note: pip install '.[vllm]' failed: $(tail -n 1 "$WORK/pip.log")"
fi
if "$PY" -c 'import vllm' >/dev/null 2>&1; then
    check vllm_engine 480 "$PY" -m pytest -q -p no:cacheprovider -rs -m vllm tests/rollout/test_rollout_vllm.py \
        tests/trainers/test_rl_vllm.py
else
    echo "SKIP vllm_engine: vLLM is not importable (pip install 'posttrain[vllm]', or POSTTRAIN_INSTALL_VLLM=1)"
fi

[ "$failed" -eq 0 ] && echo "gpu_suite: all checks passed" || echo "gpu_suite: FAILED"
exit "$failed"
