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


def test_the_env_keeps_the_engine_in_process_unless_the_caller_or_tensor_parallel_says_otherwise():
    from posttrain.rollout.vllm import engine_env, runs_in_process

    assert engine_env({}) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert runs_in_process({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert not runs_in_process({})  # vLLM's default is multiprocessing on
    # a worker in another process: collective_rpc must pickle our function (TRL sets this too)
    on = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert engine_env(on) == {**on, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert engine_env({**on, "VLLM_ALLOW_INSECURE_SERIALIZATION": "0"})["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "0"
    # tensor parallel workers are processes even with multiprocessing off: no by-reference path
    off = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert not runs_in_process(off, tensor_parallel_size=2)
    assert engine_env(off, tensor_parallel_size=2) == {**off, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def test_temperatures_vllm_would_change_or_refuse_are_reported():
    from posttrain.rollout.vllm import check_temperature

    assert all(check_temperature(t) is None for t in (0, 0.01, 0.7, 1.0, 2.0))
    for t in (0.005, 1e-6, 2.01, -1.0):
        assert "[0.01, 2.0]" in check_temperature(t)


def test_the_memory_check_names_the_setting_and_what_would_fit():
    from posttrain.rollout.vllm import check_gpu_memory

    gib = 2**30
    check_gpu_memory(60 * gib, 100 * gib, 0.5)
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=0.5 asks for 50.0 GiB .* at most 0.40"):
        check_gpu_memory(40 * gib, 100 * gib, 0.5)


def test_the_engine_is_built_to_sleep_between_rollouts():
    from posttrain.rollout.vllm import engine_kwargs

    kw = engine_kwargs("/ckpt", "bfloat16", 0.3, 5, tensor_parallel_size=2, enforce_eager=True)
    assert kw == {"model": "/ckpt", "tokenizer": "/ckpt", "dtype": "bfloat16", "gpu_memory_utilization": 0.3,
                  "seed": 5, "enable_sleep_mode": True, "logprobs_mode": "processed_logprobs",
                  "tensor_parallel_size": 2, "enforce_eager": True}


def test_auto_dtype_serves_a_float32_policy_in_16_bits():
    from posttrain.rollout.vllm import serving_dtype

    assert serving_dtype(torch.float32, bf16_supported=True) == "bfloat16"
    assert serving_dtype(torch.float32, bf16_supported=False) == "float16"
    assert serving_dtype(torch.bfloat16, bf16_supported=True) == "bfloat16"
    assert serving_dtype(torch.float16, bf16_supported=True) == "float16"


# vLLM's attention backends: FlashAttention and FlashInfer refuse float32, Triton attention needs
# heads >= 32 wide, flex attention fails to compile under 16: the GPU policy has 32-wide heads.
WIDE_HEADS = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def gpu_policy():
    return randomized(seed=3, **WIDE_HEADS).cuda()


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
    policy = randomized(seed=4, **WIDE_HEADS).cuda()
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
        for p, q in zip(policy.parameters(), randomized(seed=5, **WIDE_HEADS).cuda().parameters()):
            p.copy_(q)
    engine.sync_weights(policy)
    after = engine.generate(PROMPTS, params)
    expected = make_engine("native", policy, tok).generate(PROMPTS, params).response_ids
    assert not torch.equal(before, after.response_ids)
    assert torch.equal(after.response_ids, expected)


@pytest.mark.gpu
@needs_gpu
def test_vllm_serves_an_fp32_policy_in_bf16_and_sleeps_and_wakes(gpu_policy, tok):
    engine = make_engine("vllm", gpu_policy, tok, gpu_memory_utilization=0.2, enforce_eager=True,
                         max_model_len=128)
    assert engine.dtype == "bfloat16"
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0)
    out = engine.generate(PROMPTS, params)
    ref = reference_logprobs(gpu_policy, out, 1.0)
    assert (out.logprobs - ref).abs().max().item() < 0.1  # bf16 weights against the fp32 policy
    engine.offload()
    engine.sync_weights(gpu_policy)  # wakes up, loads, resets the prefix cache
    assert not engine.asleep
    assert torch.equal(engine.generate(PROMPTS, params).response_ids, out.response_ids)
