"""Rollout role: prompts in, n contiguous responses per prompt out, with what later stages need."""

import torch

from posttrain.algos import token_logprobs
from posttrain.models import BuiltinLM
from posttrain.rollout import SamplingParams, make_engine, native
from posttrain.workers import Rollout
from posttrain.workers.forward import response_logits

from .conftest import prompt_batch, rollout


def test_groups_are_contiguous_and_fields_filled(model, tok):
    b = rollout(model, tok, n=3, max_new_tokens=5)
    assert len(b) == 9 and b.uid.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert b.prompts == ["a b"] * 3 + ["c"] * 3 + ["d e f g"] * 3
    assert b.prompt_ids.shape[0] == 9 and b.prompt_mask[3].sum() == 2  # <bos> c
    assert torch.equal(b.response_mask.sum(1), b.lengths)
    assert torch.equal(b.truncated, (b.lengths == 5) & (b.response_ids.gather(1, (b.lengths - 1)[:, None])[:, 0] != 2))
    assert b.meta["n"] == 3 and len(b.completions) == 9


def test_rollout_logprobs_match_a_teacher_forced_forward(model, tok):
    b = rollout(model, tok, n=2, max_new_tokens=6)
    with torch.no_grad():
        logp = token_logprobs(response_logits(model, b), b.response_ids, 1.0)
    mask = b.response_mask.bool()
    assert torch.allclose(logp[mask], b.rollout_logp[mask], atol=1e-5)


def test_chat_prompts_get_message_completions(model, tok):
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    worker = Rollout(make_engine("native", model, tok), SamplingParams(n=2, max_new_tokens=2))
    chat = [[{"role": "user", "content": "a b"}]]
    b = worker.generate(prompt_batch(tok, chat), seed=0)
    assert b.completions[0][0]["role"] == "assistant" and isinstance(b.completions[0][0]["content"], str)


def test_same_seed_same_samples(model, tok):
    assert torch.equal(rollout(model, tok, seed=5).response_ids, rollout(model, tok, seed=5).response_ids)


def test_fused_decode_step_equals_the_decoder_layers(model, tok, monkeypatch):
    """The native engine's decode step on `DecodeWeights` (fused, (in, out) matrices; RoPE on q and k at once)
    samples what the model's own layers sample, with and without grouped KV heads."""
    torch.manual_seed(1)
    gqa = BuiltinLM.from_preset("tiny", vocab_size=len(tok), num_hidden_layers=2, hidden_size=64,
                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, seed=3)
    for m in (model, gqa):
        fused = make_engine("native", m, tok).generate(["a b", "c", "d e f g"], params)
        assert native.DecodeWeights.of(native.as_builtin(m)) is not None
        with monkeypatch.context() as patch:
            patch.setattr(native.DecodeWeights, "of", classmethod(lambda cls, model: None))  # the layers as modules
            layers = make_engine("native", m, tok).generate(["a b", "c", "d e f g"], params)
        assert torch.equal(fused.response_ids, layers.response_ids)
        torch.testing.assert_close(fused.logprobs, layers.logprobs, atol=1e-6, rtol=1e-6)
