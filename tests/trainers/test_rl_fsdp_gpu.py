"""FSDP2 inside Ray workers on CUDA (benchmarks/gpu_suite.sh runs these; skipped without CUDA):
a Ray worker on its GPU (NCCL) with its models sharded (one worker: the suite's machine has one
GPU; sharding over several is tested on CPUs, tests/trainers/test_rl_fsdp.py) and bf16 compute
over fp32 shards, with trainer.fsdp.param_offload, then with trainer.fsdp.optimizer_offload.
Each GRPO run trains 3 steps with finite gradients, and the final weights (gathered from the
shards) are float32."""

import math

import pytest
import torch
from safetensors.torch import load_file

from .test_rl_ray import grpo_config, lines, tiny_model_f64, train_grpo

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP2 on CUDA workers needs a CUDA GPU")]

RUNS = {
    "1 NCCL worker, param_offload": {"trainer.n_workers_per_node": 1, "placement.gpus_per_worker": 1,
                                     "trainer.fsdp.param_offload": "true"},
    "1 NCCL worker, optimizer_offload": {"trainer.n_workers_per_node": 1, "placement.gpus_per_worker": 1,
                                         "trainer.fsdp.optimizer_offload": "true"},
}


@pytest.mark.parametrize("name", list(RUNS))
def test_fsdp2_workers_train_on_cuda_in_bf16_with_offload(ray_session, tmp_path, name):
    model = tiny_model_f64().float().cuda()
    cfg = grpo_config(tmp_path, **{"trainer.backend": "ray", "trainer.strategy": "fsdp2", "trainer.precision": "bf16",
                                   "model.device": "cuda", **RUNS[name]})
    state = train_grpo(model, cfg)["actor"]
    steps = lines(tmp_path)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(math.isfinite(m["grad_norm"]) for m in steps)
    start = model.state_dict()
    assert max(float((v.cpu() - start[k].cpu()).abs().max()) for k, v in state.items()) > 1e-5
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.float32}  # the fp32 master shards, gathered
