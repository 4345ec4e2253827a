"""vllm engine. Without vLLM only its pure parts run (and the install message is checked);
with vLLM (its CPU build in `make test-vllm`, or CUDA on a GPU box: benchmarks/gpu_suite.sh) the
`vllm`-marked tests check the engine against the native engine and teacher forcing. One engine
per fixture, built once per module (a start takes 5-40 s on CI's 2 cores)."""

import importlib.util
import itertools
import re
from dataclasses import dataclass

import pytest
import torch

from posttrain.algos import token_logprobs
from posttrain.envs import ArithmeticTools, play_episodes
from posttrain.models import BuiltinConfig, BuiltinLM, forward_logits
from posttrain.models.builtin import next_token_loss
from posttrain.rollout import MultiTurnLimits, SamplingParams, make_engine
from posttrain.rollout.vllm_platform import Platform

from .conftest import PROMPTS, randomized

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm engine tests need vLLM: `make test-vllm` runs them "
                                                      "on its CPU build (docs/vllm.md)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the policy lives: the GPU under vLLM's CUDA build, else the CPU build's host memory."""


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_missing_vllm_says_how_to_install(model, tok):
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[vllm\]' on a CUDA machine, or vLLM's CPU build"):
        make_engine("vllm", model, tok)


def test_the_env_keeps_the_engine_in_process_unless_the_caller_or_tensor_parallel_says_otherwise():
    from posttrain.rollout.vllm_platform import engine_env, runs_in_process

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
    from posttrain.config.rollout import check_vllm_temperature as check_temperature

    assert all(check_temperature(t) is None for t in (0, 0.01, 0.7, 1.0, 2.0))
    for t in (0.005, 1e-6, 2.01, -1.0):
        assert "[0.01, 2.0]" in check_temperature(t)


def test_the_memory_checks_name_the_setting_and_what_would_fit():
    from posttrain.rollout.vllm_platform import check_cpu_memory, check_gpu_memory

    gib = 2**30
    check_gpu_memory(60 * gib, 100 * gib, 0.5)
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=0.5 asks for 50.0 GiB .* at most 0.40"):
        check_gpu_memory(40 * gib, 100 * gib, 0.5)
    check_cpu_memory(3 * gib, 24 * gib, 2)
    with pytest.raises(RuntimeError, match=r"cpu_kvcache_space_gb=4 asks for 4 GiB .* 3.5 of 24.0 GiB .* at most 3"):
        check_cpu_memory(int(3.5 * gib), 24 * gib, 4)


def test_the_engine_sleeps_between_rollouts_only_where_the_platform_has_sleep_mode():
    from posttrain.rollout.vllm_platform import engine_kwargs

    kw = engine_kwargs("/ckpt", "bfloat16", 0.3, 5, tensor_parallel_size=2, enforce_eager=True)
    assert kw == {"model": "/ckpt", "tokenizer": "/ckpt", "dtype": "bfloat16", "gpu_memory_utilization": 0.3,
                  "seed": 5, "enable_sleep_mode": True, "logprobs_mode": "processed_logprobs",
                  "enable_prefix_caching": True, "tensor_parallel_size": 2, "enforce_eager": True}
    assert engine_kwargs("/ckpt", "float32", 0.3, 5, sleep_mode=False)["enable_sleep_mode"] is False  # vLLM-CPU


CPU = Platform(device="cpu", sleep_mode=False, bf16=True)
CUDA = Platform(device="cuda", sleep_mode=True, bf16=True)


def test_the_kv_cache_is_sized_per_engine_and_a_disagreeing_env_variable_is_refused():
    """One mechanism for both engines: vLLM's kv_cache_memory_bytes, no environment mutation."""
    from posttrain.rollout.vllm_platform import kv_cache_kwargs

    opt = "rollout.vllm.cpu_kvcache_space_gb"
    assert kv_cache_kwargs(2, CPU, {}, opt) == {"kv_cache_memory_bytes": 2 * 2**30}
    assert kv_cache_kwargs(0.25, CPU, {}, "--kv-cache-gb") == {"kv_cache_memory_bytes": 2**28}
    assert kv_cache_kwargs(None, CPU, {"VLLM_CPU_KVCACHE_SPACE": "3"}, opt) == {}  # unset: vLLM's own sizing
    assert kv_cache_kwargs(2, CPU, {"VLLM_CPU_KVCACHE_SPACE": "2"}, opt) == {"kv_cache_memory_bytes": 2 * 2**30}
    assert kv_cache_kwargs(2, CUDA, {"VLLM_CPU_KVCACHE_SPACE": "5"}, opt) == {"kv_cache_memory_bytes": 2 * 2**30}
    # vLLM's CPU build would let the variable replace the option: refused, naming both
    with pytest.raises(ValueError, match=r"VLLM_CPU_KVCACHE_SPACE=3 is set .* instead of "
                                         r"rollout.vllm.cpu_kvcache_space_gb=2: unset it"):
        kv_cache_kwargs(2, CPU, {"VLLM_CPU_KVCACHE_SPACE": "3"}, opt)


def test_the_weights_sent_include_a_tied_head_and_drop_peft_infixes(model):
    from posttrain.rollout.vllm_platform import named_weights

    names = dict(named_weights(model))
    assert set(names) == set(model.state_dict())  # reload_weights keeps serving an old head it is not sent
    assert names["lm_head.weight"].data_ptr() == names["model.embed_tokens.weight"].data_ptr()  # tied: one tensor
    assert model.config.tie_word_embeddings


def test_a_sync_that_does_not_match_the_engine_is_refused_before_anything_loads(model):
    from posttrain.rollout.vllm_platform import check_sync_weights, named_weights, weight_shapes

    weights = named_weights(model)
    expected = weight_shapes(weights)
    check_sync_weights(weights, expected)
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]\); nothing was loaded"):
        check_sync_weights([w for w in weights if w[0] != "lm_head.weight"], expected)
    bigger = [(k, torch.zeros(v.shape[0] + 1, *v.shape[1:]) if k == "model.norm.weight" else v) for k, v in weights]
    with pytest.raises(ValueError, match=r"reshaped or retyped \['model.norm.weight'\]; model.norm.weight: \(\(33,\)"):
        check_sync_weights(bigger, expected)
    with pytest.raises(ValueError, match=r"unknown \['extra.weight'\]"):
        check_sync_weights([*weights, ("extra.weight", torch.zeros(1))], expected)
    halves = [(k, v.half()) for k, v in weights]
    with pytest.raises(ValueError, match="reshaped or retyped"):
        check_sync_weights(halves, expected)


@dataclass
class Logprob:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # the fields of vllm.outputs.CompletionOutput a model turn reads
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    text: str = ""


def test_a_vllm_completion_becomes_a_model_turn_with_the_sampled_tokens_logprobs():
    from posttrain.rollout.vllm_rows import model_turn, row_result

    # with logprobs=1 (or a sampled token that is not the top one) a step holds more entries
    steps = [{7: Logprob(-0.5, 1)}, {9: Logprob(-2.25, 3), 4: Logprob(-0.1, 1)}, {60: Logprob(-1.0, 1)}]
    called = model_turn(row_result(CompletionOutput([7, 9, 60], steps, "stop", stop_reason="</call>")))
    assert called.token_ids == [7, 9, 60] and called.logprobs == [-0.5, -2.25, -1.0]
    assert called.called and not called.cut_short
    eos = model_turn(row_result(CompletionOutput([7, 2], steps[:1] + [{2: Logprob(-3.0)}], "stop", stop_reason=2)))
    assert not eos.called and not eos.cut_short and eos.logprobs == [-0.5, -3.0]
    long = model_turn(row_result(CompletionOutput([7], steps[:1], "length")))
    assert long.cut_short and not long.called  # the turn loop tells budget from max_model_len


def test_a_vllm_completion_without_a_logprob_per_token_is_refused():
    from posttrain.rollout.vllm_rows import model_turn, row_result, sampled_logprobs

    with pytest.raises(ValueError, match="no log-probs"):
        model_turn(row_result(CompletionOutput([7], None, "length")))
    with pytest.raises(ValueError, match="1 log-prob steps for 2 tokens"):
        sampled_logprobs([7, 8], [{7: Logprob(-0.5)}])


def test_both_vllm_engines_build_a_row_s_request_and_read_its_answer_alike(tok):
    """The colocated engine and server mode share these: a row's SamplingParams arguments (the
    server gets the JSON in between) and the Completions built from the rows vLLM returns."""
    from posttrain.rollout.vllm_rows import (
        completions_from_rows,
        request_sampling,
        row_result,
        sampling_kwargs,
    )

    params = SamplingParams(n=2, temperature=0.7, top_k=5, max_new_tokens=3, stop=("</s>",))
    kw = sampling_kwargs(request_sampling(params, [2]), 3, seed=11)
    assert kw == {"n": 1, "temperature": 0.7, "top_p": 1.0, "top_k": 5, "min_p": 0.0, "max_tokens": 3,
                  "stop": ["</s>"], "stop_token_ids": [2], "ignore_eos": True, "include_stop_str_in_output": False,
                  "seed": 11, "logprobs": 0}
    no_logp = sampling_kwargs(request_sampling(SamplingParams(logprobs=False, stop_token_ids=()), []), 4, None)
    assert no_logp["logprobs"] is None and no_logp["stop"] is None and no_logp["stop_token_ids"] == []
    rows = [row_result(CompletionOutput([7, 9, 2], [{7: Logprob(-0.5)}, {9: Logprob(-1.5)}, {2: Logprob(-0.25)}],
                                        "stop", stop_reason=2)),
            row_result(CompletionOutput([8], [{8: Logprob(-2.0)}], "length"))]
    out = completions_from_rows(rows, [[1, 5], [1, 5]], params, tok, 0, meta={"engine": "vllm"})
    assert out.response_ids.tolist() == [[7, 9, 2], [8, 0, 0]] and out.lengths.tolist() == [3, 1]
    assert out.logprobs.tolist() == [[-0.5, -1.5, -0.25], [-2.0, 0.0, 0.0]]
    assert out.finish_reason == ["stop", "length"] and out.num_tokens == 4 and len(out) == 2


def test_request_seeds_are_distinct_over_an_episodes_rows_and_turns():
    from posttrain.rollout.vllm_rows import request_seed

    assert request_seed(None, 3, turn=2, rows=8) is None  # vLLM's own RNG
    assert [request_seed(10, r) for r in range(3)] == [10, 11, 12]  # single-turn: seed + row
    seeds = [request_seed(10, r, t, rows=8) for r in range(8) for t in range(5)]
    assert len(set(seeds)) == len(seeds) and request_seed(10, 5, 0, rows=8) == request_seed(10, 5)


# vLLM's attention backends: FlashAttention and FlashInfer refuse float32, Triton attention needs
# heads >= 32 wide, flex attention fails to compile under 16, the CPU build's serves 32, 64, ...
# wide heads: the policy has 32-wide heads.
WIDE_HEADS = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1}
ENGINE = {"enforce_eager": True, "max_model_len": 128}  # no compile: a start in seconds


@pytest.fixture(scope="module")
def policy():
    """The fp32 engine's policy; test_vllm_sync_weights changes it and puts it back."""
    return randomized(seed=3, **WIDE_HEADS).to(DEVICE)


@pytest.fixture(scope="module")
def vllm_engine(policy, tok):
    return make_engine("vllm", policy, tok, dtype="float32", gpu_memory_utilization=0.2, **ENGINE)


def reference_logprobs(model, out, temperature):
    """The trainer's log-probs of `out`'s tokens: one teacher-forced forward per row."""
    ref = torch.zeros_like(out.logprobs)
    for row, prompt in enumerate(out.prompt_ids):
        n = int(out.lengths[row])
        seq = torch.tensor(prompt + out.response_ids[row, :n].tolist(), device=DEVICE)[None]
        with torch.no_grad():
            logp = token_logprobs(forward_logits(model, seq)[:, :-1], seq[:, 1:], temperature)[0]
        ref[row, :n] = logp[len(prompt) - 1 :].cpu()
    return ref


@pytest.mark.vllm
@needs_vllm
def test_vllm_greedy_equals_native_greedy(vllm_engine, policy, tok):
    params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[])
    ours = make_engine("native", policy, tok).generate(PROMPTS, params)
    theirs = vllm_engine.generate(PROMPTS, params)
    assert vllm_engine.dtype == "float32"
    assert torch.equal(theirs.response_ids, ours.response_ids)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_rows_grouped_and_logprobs_match_teacher_forcing(vllm_engine, policy, temperature):
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=16, seed=0)
    out = vllm_engine.generate(PROMPTS, params)
    assert out.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert torch.equal(out.response_mask.sum(-1), out.lengths)
    ref = reference_logprobs(policy, out, temperature)
    assert (out.logprobs - ref).abs().max().item() < 1e-4  # fp32, other kernels (measured ~1e-6 on CPU)
    again = vllm_engine.generate(PROMPTS, params)
    assert torch.equal(out.response_ids, again.response_ids)


@pytest.mark.vllm
@needs_vllm
def test_vllm_row_seeds_give_each_row_its_tokens_whatever_the_batch(vllm_engine):
    """seed_mode=row: a batch generated in two slices (first_row) gives the whole batch's rows,
    and another seed other rows."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=11, seed_mode="row", stop_token_ids=[])
    whole = vllm_engine.generate(PROMPTS, params)
    head = vllm_engine.generate(PROMPTS[:1], params)
    rest = vllm_engine.generate(PROMPTS[1:], SamplingParams(**{**params.__dict__, "first_row": 2}))
    assert torch.equal(torch.cat([head.response_ids, rest.response_ids]), whole.response_ids)
    other = vllm_engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 12}))
    assert not torch.equal(other.response_ids, whole.response_ids)


@pytest.mark.vllm
@needs_vllm
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


@pytest.mark.vllm
@needs_vllm
def test_vllm_sync_weights_serves_the_updated_policy_tied_head_included(vllm_engine, policy, tok):
    """In-place sync: the next generation is the native engine's on the new weights (greedy,
    fp32), and the log-probs are the new policy's: the tied lm_head was loaded too (left out,
    the CPU build serves its old head). A sync that does not fit is refused before anything
    loads, and the engine serves on; syncing the old weights back restores the first tokens."""
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[])
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    before = vllm_engine.generate(PROMPTS, params).response_ids
    try:
        with torch.no_grad():  # an "update": new weights in the same tensors
            for p, q in zip(policy.parameters(), randomized(seed=5, **WIDE_HEADS).parameters()):
                p.copy_(q)
        vllm_engine.sync_weights(policy)
        after = vllm_engine.generate(PROMPTS, params)
        expected = make_engine("native", policy, tok).generate(PROMPTS, params).response_ids
        assert not torch.equal(before, after.response_ids)
        assert torch.equal(after.response_ids, expected)
        sampled = vllm_engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3))
        assert (sampled.logprobs - reference_logprobs(policy, sampled, 1.0)).abs().max().item() < 1e-4
        wrong = randomized(seed=6, **{**WIDE_HEADS, "intermediate_size": 80})
        with pytest.raises(ValueError, match=r"reshaped or retyped .*nothing was loaded"):
            vllm_engine.sync_weights(wrong)
        assert vllm_engine.broken is None
        assert torch.equal(vllm_engine.generate(PROMPTS, params).response_ids, expected)
    finally:
        policy.load_state_dict(original)
        vllm_engine.sync_weights(policy)
    assert torch.equal(vllm_engine.generate(PROMPTS, params).response_ids, before)


@pytest.fixture(scope="module")
def auto_engine(policy, tok):
    """An engine at dtype auto; the last test of the module breaks it."""
    return make_engine("vllm", policy, tok, gpu_memory_utilization=0.2, **ENGINE)


def auto_dtype_here(platform: Platform) -> str:
    """What dtype auto must serve a float32 policy in on this machine, found without our code's
    decision: on a CPU bf16 only with a bf16 flag in /proc/cpuinfo (vLLM lists it on every x86
    and Arm CPU), on CUDA bf16 from Ampere on (vLLM's list), else float32 / float16."""
    if platform.cpu:
        cpuinfo = open("/proc/cpuinfo").read()
        return "bfloat16" if re.search(r"^(flags|Features)\s*:.*\b(avx512_bf16|amx_bf16|bf16)\b", cpuinfo, re.M) \
            else "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


@pytest.mark.vllm
@needs_vllm
def test_vllm_auto_dtype_serves_an_fp32_policy_in_bf16_only_where_it_is_native_and_offload_is_safe(auto_engine,
                                                                                                    policy):
    """dtype=auto: bf16 where the device computes it natively (CUDA from Ampere on; a CPU with
    AVX-512-BF16, AMX or Arm BF16), else float32 on a CPU (this CI machine, AVX2 only, where vLLM's
    emulated bf16 is 3.5-3.8x slower) and float16 on an older GPU. In 16 bits its log-probs differ
    from the fp32 trainer's by the rounding: the gap rollout correction is for (measured on the
    CPU build in bf16: mean 0.052, max 0.36; this random policy's logits are large, so bf16 rounding
    moves them by ~1e-2; tests/trainers/test_rl_vllm.py serves bf16 on any CPU); in float32 they are
    the trainer's. offload() sleeps on CUDA; on the CPU build, which has no sleep mode, it leaves
    the engine as it is, and the sync and generation go on."""
    engine = auto_engine
    assert engine.dtype == auto_dtype_here(engine.platform)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0)
    out = engine.generate(PROMPTS, params)
    gap = (out.logprobs - reference_logprobs(policy, out, 1.0)).abs()[out.response_mask.bool()]
    print(f"{engine.dtype} engine vs fp32 trainer: mean {gap.mean():.4f}, max {gap.max():.4f}")
    if engine.dtype == "float32":
        assert gap.max() < 1e-4  # the trainer's own numbers
    else:
        assert 1e-3 < gap.mean() < 0.1 and gap.max() < 1.0  # 16-bit weights against the fp32 policy: a gap
    engine.offload()
    assert engine.asleep == engine.platform.sleep_mode
    engine.sync_weights(policy)  # wakes up, loads, resets the prefix cache
    assert not engine.asleep
    assert torch.equal(engine.generate(PROMPTS, params).response_ids, out.response_ids)


@pytest.mark.vllm
@needs_vllm
def test_a_sync_failing_midway_fails_the_step_and_the_engine_refuses_to_generate(auto_engine, vllm_engine, policy,
                                                                                  tok):
    """A tensor vLLM cannot copy from (on the meta device: right name, shape and dtype, so the
    checks pass) in the second layer: the first layer has loaded when the load fails. The sync
    raises naming the failure, and the engine, partly updated, generates nothing after. Another
    engine of this process is unharmed: vLLM shares layers (its rotary embeddings) between
    engines of the same shape and dtype, which the failed reload had left as meta tensors."""
    broken = randomized(seed=3, **WIDE_HEADS)
    down = broken.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.empty(down.weight.shape, device="meta"))
    with pytest.raises(RuntimeError, match=r"weight sync failed midway .*partly old, partly new .*trainer.resume=auto"):
        auto_engine.sync_weights(broken)
    assert auto_engine.broken is not None
    with pytest.raises(RuntimeError, match="will not generate from partly updated weights"):
        auto_engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="weight sync failed midway"):
        auto_engine.sync_weights(policy)
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[])
    assert torch.equal(vllm_engine.generate(PROMPTS, params).response_ids,
                       make_engine("native", policy, tok).generate(PROMPTS, params).response_ids)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_vllm_serves_a_lora_policy_after_each_adapter_update(policy, tok, tmp_path, lora_sync):
    """A peft policy over the base checkpoint (model_path). "adapter": only the adapter goes to
    the engine (vLLM's LoRA, x·W + α/r·x·A·B); "merged": W + α/r·BA is loaded. Either way, after
    an adapter update the next greedy generation is the native engine's on the merged model, and
    the log-probs are the peft policy's."""
    import peft

    base_dir = tmp_path / "base"
    policy.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    lora = peft.get_peft_model(randomized(seed=3, **WIDE_HEADS).to(DEVICE),
                               peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    engine = make_engine("vllm", lora, tok, model_path=str(base_dir), dtype="float32", lora_sync=lora_sync, **ENGINE)
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[])
    first = engine.generate(PROMPTS, params).response_ids
    assert torch.equal(first, make_engine("native", policy, tok).generate(PROMPTS, params).response_ids)  # B = 0
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    engine.sync_weights(lora)
    lora.merge_adapter()
    expected = make_engine("native", lora.get_base_model(), tok).generate(PROMPTS, params).response_ids
    lora.unmerge_adapter()
    after = engine.generate(PROMPTS, params).response_ids
    assert not torch.equal(after, first) and torch.equal(after, expected)
    sampled = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3))
    assert (sampled.logprobs - reference_logprobs(lora, sampled, 1.0)).abs().max().item() < 1e-4


def test_vllms_lora_serves_plain_adapters_at_a_rank_it_accepts():
    import peft

    from posttrain.rollout.vllm_platform import lora_engine_kwargs

    assert lora_engine_kwargs(peft.LoraConfig(r=4)) == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    assert lora_engine_kwargs(peft.LoraConfig(r=16, rank_pattern={"q_proj": 24}))["max_lora_rank"] == 32
    with pytest.raises(ValueError, match=r"does not serve this adapter \(use_dora\); set rollout.vllm.lora_sync=merged"):
        lora_engine_kwargs(peft.LoraConfig(r=8, use_dora=True))


# ---------------------------------------------------------------- episodes on the vllm engine

TOOL_PROMPT = "23*47+58*91="
TOOL_DEMO = ("<call>calculator(23*47)</call><result>1081</result><call>calculator(58*91)</call>"
             "<result>5278</result><call>calculator(1081+5278)</call><result>6359</result>\nAnswer: 6359")
TOOL_ROWS = [{"prompt": TOOL_PROMPT, "answer": "6359"}]
TOOL_LIMITS = MultiTurnLimits(max_turns=4, max_total_tokens=200)


def teach_tool_episode(tok, device: str) -> BuiltinLM:
    """A model of the GPU policy's shape taught one `arithmetic_tools` episode: greedy decoding
    of TOOL_PROMPT gives TOOL_DEMO (three calculator calls, their results, the answer), then EOS."""
    torch.manual_seed(0)
    config = BuiltinConfig(vocab_size=len(tok), num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0, **WIDE_HEADS)
    model = BuiltinLM(config).to(device)
    ids = torch.tensor([tok(TOOL_PROMPT + TOOL_DEMO)["input_ids"] + [tok.eos_token_id]], device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(600):
        loss = next_token_loss(model(ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    return model.eval()


def check_tool_episodes(out, tok, params: SamplingParams, limits: MultiTurnLimits) -> None:
    """The mask is 0 exactly on the environment's answers: the trajectory alternates model
    turns (runs of 1, each at most max_new_tokens) and `<result>…</result>` answers (runs of
    0), one answer after every turn but the last; log-probs are 0 off model tokens; limits hold."""
    assert (out.turns <= limits.max_turns).all() and (out.total_lengths <= limits.max_total_tokens).all()
    for row in range(len(out)):
        ids = out.response_ids[row, : int(out.total_lengths[row])].tolist()
        mask = out.response_mask[row, : len(ids)].tolist()
        runs = [(m, [t for t, _ in grp]) for m, grp in itertools.groupby(zip(ids, mask), key=lambda p: p[1])]
        assert [m for m, _ in runs] == [1, 0] * (int(out.turns[row]) - 1) + [1]
        for m, toks in runs:
            text = tok.decode(toks, skip_special_tokens=True)
            if m == 0:
                assert re.fullmatch(r"(<result>[^<]*</result>)+", text), text
            else:
                assert len(toks) <= params.max_new_tokens
        assert int(out.lengths[row]) == sum(mask)
        assert out.logprobs[row, : len(ids)][out.response_mask[row, : len(ids)] == 0].abs().sum() == 0


@pytest.fixture(scope="module")
def tool_policy(tok):
    return teach_tool_episode(tok, DEVICE)


@pytest.fixture(scope="module")
def tool_engine(tool_policy, tok):
    return make_engine("vllm", tool_policy, tok, dtype="float32", gpu_memory_utilization=0.15,
                       enforce_eager=True, max_model_len=256)


@pytest.mark.vllm
@needs_vllm
def test_vllm_plays_the_calculator_episode_as_the_native_engine(tool_engine, tool_policy, tok):
    params = SamplingParams(n=2, temperature=0, max_new_tokens=48)
    out, rewards, metrics = play_episodes(tool_engine, TOOL_ROWS, ArithmeticTools, params, TOOL_LIMITS)
    assert out.meta["engine"] == "vllm" and out.texts == [TOOL_DEMO] * 2
    assert out.turn_texts[0] == ["<call>calculator(23*47)</call>", "<call>calculator(58*91)</call>",
                                 "<call>calculator(1081+5278)</call>", "\nAnswer: 6359"]
    assert rewards.tolist() == [1.0, 1.0] and metrics["tool_calls/mean"] == 3.0
    check_tool_episodes(out, tok, params, TOOL_LIMITS)
    native, _, _ = play_episodes(make_engine("native", tool_policy, tok), TOOL_ROWS, ArithmeticTools, params,
                                 TOOL_LIMITS)
    assert torch.equal(out.response_ids, native.response_ids)
    assert torch.equal(out.response_mask, native.response_mask)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("limits", [TOOL_LIMITS, MultiTurnLimits(max_turns=2, max_total_tokens=60)])
def test_vllm_sampled_episodes_mask_answers_keep_limits_repeat_and_match_teacher_forcing(
    tool_engine, tool_policy, tok, limits
):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=7)

    def play():
        tool_engine.llm.reset_prefix_cache()  # both runs find the same cache: identical kernels
        return play_episodes(tool_engine, TOOL_ROWS, ArithmeticTools, params, limits)[0]

    out = play()
    check_tool_episodes(out, tok, params, limits)
    if limits is not TOOL_LIMITS:  # 60 tokens cannot hold the demo: the last turn's budget cut it
        assert (out.total_lengths == limits.max_total_tokens).any()
    again = play()
    assert torch.equal(out.response_ids, again.response_ids) and torch.equal(out.response_mask, again.response_mask)
    for row in range(len(out)):  # the actor's teacher-forced forward over prompt + trajectory
        n, prompt = int(out.total_lengths[row]), out.prompt_ids[row]
        seq = torch.tensor(prompt + out.response_ids[row, :n].tolist(), device=tool_policy.device)[None]
        with torch.no_grad():
            ref = token_logprobs(forward_logits(tool_policy, seq)[:, :-1], seq[:, 1:], 1.0)[0, len(prompt) - 1 :]
        model_tokens = out.response_mask[row, :n].bool()
        diff = (out.logprobs[row, :n][model_tokens] - ref.cpu()[model_tokens]).abs().max().item()
        assert diff < 1e-3  # different kernels, fp32 (as the single-turn test)
