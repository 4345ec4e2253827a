"""BuiltinLM as a whole: presets, tying, causality, the loss shift, padding, packing."""

import math

import pytest
import torch

from posttrain.models import PRESETS, BuiltinConfig, BuiltinLM, next_token_loss


@pytest.mark.parametrize("name,count", [("tiny", 1_832_640), ("small", 25_862_656)])
def test_preset_parameter_counts_match_docs(name, count):
    with torch.device("meta"):
        model = BuiltinLM.from_preset(name, vocab_size=320)
    assert model.num_parameters() == count
    assert name in PRESETS and str(f"{count:,}") in BuiltinLM.from_preset.__doc__


def test_preset_overrides_and_unknown_name():
    with torch.device("meta"):
        model = BuiltinLM.from_preset("tiny", 100, num_key_value_heads=2, tie_word_embeddings=False)
    assert model.config.num_key_value_heads == 2
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 32, 192)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        BuiltinLM.from_preset("huge", 100)


def test_config_validation_names_the_field(tiny_kwargs):
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide"):
        BuiltinConfig(**{**tiny_kwargs, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_scaling lacks"):
        BuiltinConfig(**tiny_kwargs, rope_scaling={"factor": 8.0})
    assert BuiltinConfig(**tiny_kwargs).head_dim == 8


def test_tied_weights_are_one_tensor_through_a_training_step(tiny_lm, tiny_kwargs):
    emb, head = tiny_lm.model.embed_tokens.weight, tiny_lm.lm_head.weight
    assert head is emb and head.data_ptr() == emb.data_ptr()
    optimizer = torch.optim.AdamW(tiny_lm.parameters(), lr=1e-2)
    ids = torch.randint(0, 61, (2, 6))
    next_token_loss(tiny_lm(ids), ids).backward()
    optimizer.step()
    assert tiny_lm.lm_head.weight.data_ptr() == tiny_lm.model.embed_tokens.weight.data_ptr()
    untied = BuiltinLM(BuiltinConfig(**{**tiny_kwargs, "tie_word_embeddings": False}))
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_hidden_states_feed_the_head(tiny_lm):
    ids = torch.randint(0, 61, (2, 5))
    hidden = tiny_lm.hidden_states(ids)
    assert hidden.shape == (2, 5, 32)
    assert torch.allclose(tiny_lm.lm_head(hidden), tiny_lm(ids))


def test_future_tokens_never_change_earlier_outputs(tiny_lm):
    ids = torch.randint(0, 61, (1, 8))
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 7) % 61
    a, b = tiny_lm(ids), tiny_lm(changed)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-3)


def test_loss_position_t_predicts_token_t_plus_1():
    # V = 3, labels [0, 1, 2]. Position 0 is uniform -> target 1 costs ln 3;
    # position 1 has logits [0, 0, ln 2] -> p(2) = 2/4 -> target 2 costs ln 2;
    # position 2 predicts nothing (no token 3).
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 0.0, math.log(2)], [9.0, -9.0, 5.0]]])
    labels = torch.tensor([[0, 1, 2]])
    assert torch.allclose(
        next_token_loss(logits, labels), torch.tensor((math.log(3) + math.log(2)) / 2)
    )
    # -100 and padding remove targets: only the target at position 2 (ln 2) remains
    assert torch.allclose(
        next_token_loss(logits, torch.tensor([[0, -100, 2]])), torch.tensor(math.log(2))
    )
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(next_token_loss(logits, labels, mask), torch.tensor(math.log(3)))
    assert next_token_loss(logits, torch.full((1, 3), -100)) == 0


def pad(ids: torch.Tensor, length: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) ids -> (1, length) ids padded with token 0, and the (1, length) mask."""
    n_pad = length - ids.numel()
    filler, ones = torch.zeros(n_pad, dtype=torch.long), torch.ones(ids.numel(), dtype=torch.long)
    parts = [(filler, filler), (ids, ones)] if left else [(ids, ones), (filler, filler)]
    return torch.cat([p[0] for p in parts])[None], torch.cat([p[1] for p in parts])[None]


@pytest.mark.parametrize("left", [True, False])
def test_padding_never_changes_logits_or_loss(tiny_lm, left):
    seqs = [torch.randint(1, 61, (n,)) for n in (7, 4, 1)]
    padded = [pad(s, 7, left) for s in seqs]
    ids, mask = torch.cat([p[0] for p in padded]), torch.cat([p[1] for p in padded])
    logits = tiny_lm(ids, attention_mask=mask)
    assert torch.isfinite(logits).all()
    for row, seq in enumerate(seqs):
        alone = tiny_lm(seq[None])[0]
        real = logits[row][mask[row].bool()]
        assert torch.allclose(real, alone, atol=1e-5)
        padded_loss = next_token_loss(
            logits[row : row + 1], ids[row : row + 1], mask[row : row + 1]
        )
        assert torch.allclose(padded_loss, next_token_loss(alone[None], seq[None]), atol=1e-5)


def test_all_padding_row_gives_no_nan(tiny_lm):
    ids = torch.randint(0, 61, (2, 4))
    mask = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])
    logits = tiny_lm(ids, attention_mask=mask)
    assert torch.isfinite(logits).all()
    assert torch.allclose(logits[1], tiny_lm(ids[1:])[0], atol=1e-6)


def test_packed_documents_do_not_attend_to_each_other(tiny_lm):
    docs = [torch.randint(0, 61, (n,)) for n in (3, 5, 2)]
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(d.numel()) for d in docs])[None]
    packed = tiny_lm(ids, position_ids=position_ids)[0]
    alone = torch.cat([tiny_lm(d[None])[0] for d in docs])
    assert torch.allclose(packed, alone, atol=1e-5)
    # Without the restarts the later documents would see the earlier ones.
    assert not torch.allclose(tiny_lm(ids)[0], alone, atol=1e-3)


def test_packed_rows_in_a_batch(tiny_lm):
    a, b, c = (torch.randint(0, 61, (n,)) for n in (4, 2, 6))
    ids = torch.stack([torch.cat([a, b]), c])
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]])
    out = tiny_lm(ids, position_ids=position_ids)
    assert torch.allclose(out[0, :4], tiny_lm(a[None])[0], atol=1e-5)
    assert torch.allclose(out[0, 4:], tiny_lm(b[None])[0], atol=1e-5)
    assert torch.allclose(out[1], tiny_lm(c[None])[0], atol=1e-5)


def test_bfloat16_model_keeps_float32_rope(tiny_kwargs, randomize):
    model = randomize(BuiltinLM(BuiltinConfig(**tiny_kwargs))).to(torch.bfloat16)
    ids = torch.randint(0, 61, (1, 6))
    logits = model(ids)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_peft_lora_targets_llama_module_names(tiny_lm):
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(0, 61, (1, 5))
    before = tiny_lm(ids)
    lora = get_peft_model(
        tiny_lm, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    wrapped = [n for n, _ in lora.named_modules() if n.endswith("lora_A")]
    assert len(wrapped) == 3 * 2
    assert torch.allclose(lora(ids), before, atol=1e-6)  # LoRA B starts at zero
