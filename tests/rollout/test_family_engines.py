"""The native engine on Qwen2, Qwen3 and Mistral models: greedy tokens are transformers'
`generate`'s, a transformers model runs on shared weights, sampled episodes match the hf
engine's. Tiny 2-layer models over the byte tokenizer, fp32, CPU."""

import pytest
import torch

from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.native import DecodeWeights, as_builtin

from .conftest import PROMPTS, randomized
from .test_episodes import run

transformers = pytest.importorskip("transformers")

FAMILIES = {"qwen2": {}, "qwen3": {"head_dim": 12}, "mistral": {}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(built-in model, the same weights loaded by plain transformers) of one family."""
    family = request.param
    model = randomized(model_type=family, **FAMILIES[family])
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model, hf.eval()


def test_native_greedy_matches_transformers_generate(pair, tok):
    model, hf = pair
    enc = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, enc))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in enc])
    mask = (ids != 0).long()
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                          eos_token_id=None, pad_token_id=0)
    params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[])
    native = make_engine("native", model, tok).generate(PROMPTS, params)
    assert torch.equal(native.response_ids, ref[:, width:])
    on_hf_weights = make_engine("native", hf, tok).generate(PROMPTS, params)  # a view, no copy
    assert torch.equal(on_hf_weights.response_ids, native.response_ids)
    assert as_builtin(hf).model.embed_tokens.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    weights = DecodeWeights.of(model)  # the fused decode step, Qwen2's bias stacked
    assert weights is not None and (weights.qkv_bias is not None) == (model.config.model_type == "qwen2")


def test_native_and_hf_give_the_same_sampled_episodes(pair, tok):
    model, hf = pair
    a, _ = run(make_engine("native", model, tok), tok)
    b, _ = run(make_engine("hf", hf, tok), tok)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
