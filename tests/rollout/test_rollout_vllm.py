"""vllm engine. Without vLLM or CUDA only the install message is checked; on a GPU box
with `posttrain[vllm]` the engine is checked against the model it serves."""

import importlib.util

import pytest
import torch

from posttrain.algos import token_logprobs
from posttrain.models import forward_logits
from posttrain.rollout import SamplingParams, make_engine

from .conftest import PROMPTS, randomized

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_gpu = pytest.mark.skipif(
    not (HAVE_VLLM and torch.cuda.is_available()),
    reason="vllm engine tests need vLLM and a CUDA GPU (pip install 'posttrain[vllm]')",
)


@pytest.mark.skipif(HAVE_VLLM and torch.cuda.is_available(), reason="vLLM and CUDA are present")
def test_missing_vllm_or_cuda_says_how_to_install(model, tok):
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[vllm\]' on a CUDA machine"):
        make_engine("vllm", model, tok)


def test_auto_dtype_serves_a_float32_policy_in_16_bits():
    from posttrain.rollout.vllm import serving_dtype

    assert serving_dtype(torch.float32, bf16_supported=True) == "bfloat16"
    assert serving_dtype(torch.float32, bf16_supported=False) == "float16"
    assert serving_dtype(torch.bfloat16, bf16_supported=True) == "bfloat16"
    assert serving_dtype(torch.float16, bf16_supported=True) == "float16"


@pytest.fixture(scope="module")
def gpu_policy():
    return randomized(seed=3).cuda()


@pytest.fixture(scope="module")
def vllm_engine(gpu_policy, tok):
    return make_engine(
        "vllm",
        gpu_policy,
        tok,
        dtype="float32",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        max_model_len=128,
    )


def reference_logprobs(model, out, temperature):
    ref = torch.zeros_like(out.logprobs)
    for row, prompt in enumerate(out.prompt_ids):
        n = int(out.lengths[row])
        seq = torch.tensor(prompt + out.response_ids[row, :n].tolist(), device=model.device)[None]
        with torch.no_grad():
            logp = token_logprobs(forward_logits(model, seq)[:, :-1], seq[:, 1:], temperature)[0]
        ref[row, :n] = logp[len(prompt) - 1 :].cpu()
    return ref


@pytest.mark.gpu
@needs_gpu
def test_vllm_greedy_equals_native_greedy(vllm_engine, gpu_policy, tok):
    params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[])
    ours = make_engine("native", gpu_policy, tok).generate(PROMPTS, params)
    theirs = vllm_engine.generate(PROMPTS, params)
    assert torch.equal(theirs.response_ids, ours.response_ids)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_rows_grouped_and_logprobs_match_teacher_forcing(vllm_engine, gpu_policy, temperature):
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=16, seed=0)
    out = vllm_engine.generate(PROMPTS, params)
    assert out.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert torch.equal(out.response_mask.sum(-1), out.lengths)
    ref = reference_logprobs(gpu_policy, out, temperature)
    assert (out.logprobs - ref).abs().max().item() < 1e-3  # different kernels, fp32
    again = vllm_engine.generate(PROMPTS, params)
    assert torch.equal(out.response_ids, again.response_ids)


@pytest.mark.gpu
@needs_gpu
def test_vllm_stops_like_the_other_engines(vllm_engine, tok):
    params = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[])
    free = vllm_engine.generate(PROMPTS, params)
    stop_tok = int(free.response_ids[0, 4])
    first = free.response_ids[0].tolist().index(stop_tok)
    out = vllm_engine.generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[stop_tok])
    )
    assert out.finish_reason[0] == "stop" and int(out.lengths[0]) == first + 1
    short = vllm_engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=3, stop_token_ids=[], seed=1)
    )
    assert short.finish_reason == ["length"] * len(PROMPTS)


@pytest.mark.gpu
@needs_gpu
def test_vllm_sync_weights_serves_the_updated_policy(tok):
    policy = randomized(seed=4).cuda()
    engine = make_engine(
        "vllm",
        policy,
        tok,
        dtype="float32",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[])
    before = engine.generate(PROMPTS, params).response_ids
    with torch.no_grad():  # an "update": new weights in the same tensors
        for p, q in zip(policy.parameters(), randomized(seed=5).cuda().parameters()):
            p.copy_(q)
    engine.sync_weights(policy)
    after = engine.generate(PROMPTS, params)
    expected = make_engine("native", policy, tok).generate(PROMPTS, params).response_ids
    assert not torch.equal(before, after.response_ids)
    assert torch.equal(after.response_ids, expected)
