"""model.gradient_checkpointing: every decoder layer runs again in the backward pass, and the
loss and gradients are those without it (float64, 1e-10), for the built-in model, a tiny
transformers Llama built here, their LoRA-wrapped forms and the scalar-head models."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.config import ConfigError, LoraConfig
from posttrain.models import BuiltinLM, next_token_loss
from posttrain.models.heads import ScalarHeadModel
from posttrain.models.loading import enable_gradient_checkpointing, forward_logits
from posttrain.models.lora import apply_lora

V, LAYERS = 40, 2


def builtin() -> BuiltinLM:
    torch.manual_seed(0)
    return BuiltinLM.from_preset("tiny", V, num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2).double()


def hf_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).double()


def lora(model):
    model = apply_lora(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # peft starts B at 0: give the adapters a gradient everywhere
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


MODELS = {
    "builtin": builtin,
    "hf": hf_llama,
    "builtin-lora": lambda: lora(builtin()),
    "hf-lora": lambda: lora(hf_llama()),
    "builtin-critic": lambda: ScalarHeadModel.from_causal_lm(builtin()),
    "hf-critic": lambda: ScalarHeadModel.from_causal_lm(hf_llama()),
}


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (base.backbone if isinstance(base, ScalarHeadModel) else base.model).layers


def counted(forward, calls):
    def run(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return run


def loss_and_grads(model, ids, mask):
    """A training step's loss (next-token CE, or the mean squared value for a critic) and
    every gradient, with the number of decoder-layer calls it made."""
    calls = []
    for layer in decoder_layers(model):  # what both checkpoint (not __call__, whose hooks stay outside)
        inner = layer.self_attn
        inner.forward = counted(inner.forward, calls)
    model.train()
    model.zero_grad()
    if isinstance(model, ScalarHeadModel):
        loss = (model.values(ids, mask) * mask).pow(2).sum()
    else:
        loss = next_token_loss(forward_logits(model, ids, mask), ids, mask)
    loss.backward()
    for layer in decoder_layers(model):
        del layer.self_attn.forward
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(calls)


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointing_recomputes_each_layer_with_the_same_loss_and_gradients(name):
    model = MODELS[name]()
    torch.manual_seed(1)
    ids = torch.randint(3, V, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    loss, grads, calls = loss_and_grads(model, ids, mask)
    enable_gradient_checkpointing(model)
    loss_gc, grads_gc, calls_gc = loss_and_grads(model, ids, mask)
    assert calls == LAYERS and calls_gc == 2 * LAYERS  # every layer ran again in the backward pass
    assert grads.keys() == grads_gc.keys() and len(grads) > 0
    assert abs(float(loss - loss_gc)) < 1e-10
    for k, g in grads.items():
        assert float((g - grads_gc[k]).abs().max()) < 1e-10, k


def test_a_model_without_checkpointing_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.gradient_checkpointing.*Sequential"):
        enable_gradient_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def saved_activation_bytes(model, ids) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for the backward pass after a
    training forward (next-token loss); with checkpointing, what stays across layers."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        next_token_loss(forward_logits(model, ids), ids)
    return sum(saved.values())


def test_checkpointing_keeps_only_each_layers_input_as_transformers_llama_does():
    # Side by side with transformers' Llama of the same shape: with checkpointing the built-in
    # model keeps what it keeps (each layer's input, the head's and the loss's tensors) plus its
    # RoPE tables, which it passes to each layer as checkpoint inputs (B, T, D) x 2, shared.
    ids = torch.randint(3, V, (2, 64), generator=torch.Generator().manual_seed(0))
    kept = {}
    for name in ("builtin", "hf"):
        model = MODELS[name]()
        without = saved_activation_bytes(model, ids)
        enable_gradient_checkpointing(model)
        kept[name] = saved_activation_bytes(model, ids)
        assert kept[name] < 0.2 * without, name  # 0.16 (builtin) and 0.15 (hf) of without here
    head_dim = 32 // 4
    assert kept["builtin"] <= kept["hf"] + 2 * ids.numel() * head_dim * 8
