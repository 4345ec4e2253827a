"""distributed/fsdp.py in one process (a gloo group of 1 over a file store): the sharded model
computes the plain one's logits; a tied head stays one parameter; a peft model is sharded at
its base; weights read out one gathered parameter at a time equal the originals (`full_copy`,
`stream_full`); the bytes held are read from the shards; AdamW's state offload keeps the
update. Across workers: tests/trainers/test_rl_fsdp.py."""

import copy

import pytest
import torch
import torch.distributed as dist

from posttrain.distributed.fsdp import (
    full_copy,
    is_sharded,
    offload_optimizer,
    shard_model,
    shard_root,
    skeleton,
    stream_full,
    training_bytes,
)
from posttrain.models import BuiltinLM


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny():
    torch.manual_seed(0)
    return BuiltinLM.from_preset("tiny", vocab_size=16, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                 num_attention_heads=2, num_key_value_heads=2).double()


def test_a_sharded_model_reads_out_whole_and_keeps_its_tied_head(group):
    plain = tiny()
    model = copy.deepcopy(plain)
    template = skeleton(model)
    shard_model(model)
    assert is_sharded(model) and model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 16, (2, 5))
    torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=1e-12)
    out = full_copy(model, template, keep=True)
    assert out.lm_head.weight is out.model.embed_tokens.weight  # still tied in the copy
    for (name, a), b in zip(out.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    engine = tiny()
    with torch.no_grad():
        for p in engine.parameters():
            p.zero_()
    stream_full(model, engine)
    assert all(torch.equal(a, b) for a, b in zip(engine.parameters(), plain.parameters(), strict=True))
    assert full_copy(model, template, keep=False) is None


def test_peft_is_sharded_at_its_base_and_offloaded_adamw_steps_as_in_memory(group):
    from posttrain.config.sections import LoraConfig
    from posttrain.models.lora import apply_lora

    model = apply_lora(tiny(), LoraConfig(r=4, alpha=8))
    plain = copy.deepcopy(model)
    shard_model(model)
    assert is_sharded(model) and shard_root(model) is model.get_base_model()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (model, plain)]
    offload_optimizer(opts[0])
    ids = torch.randint(0, 16, (2, 5))
    for _ in range(2):
        for m, opt in zip((model, plain), opts, strict=True):
            opt.zero_grad()
            out = m(ids)
            getattr(out, "logits", out).square().mean().backward()
            opt.step()
    held = training_bytes(model, opts[0])
    trained = sum(p.numel() for p in plain.parameters() if p.requires_grad)
    assert held["optimizer"] >= 2 * 8 * trained and held["grads"] == 8 * trained
    assert all(v.device.type == "cpu" for s in opts[0].state.values() for v in s.values())
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-12, msg=k)


def test_an_hf_llama_and_its_value_model_shard_and_compute_as_plain(group):
    """A transformers Llama (untied head) and a value model on it: the critic's two calls,
    `hidden_states` then `score` (a group of its own), give the plain model's values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models.heads import ScalarHeadModel

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)).double()
    value = ScalarHeadModel.from_causal_lm(lm, init_std=0.5)
    ids = torch.randint(0, 16, (2, 5))
    for plain in (lm, value):
        model = copy.deepcopy(plain)
        template = skeleton(model)
        shard_model(model)
        if plain is lm:
            torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=1e-12)
        else:
            got = model.score(model.hidden_states(ids))
            torch.testing.assert_close(got, plain.score(plain.hidden_states(ids)), rtol=0, atol=1e-12)
        out = full_copy(model, template, keep=True)
        for (name, a), b in zip(out.state_dict().items(), plain.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
