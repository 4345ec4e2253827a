"""The built-in decoder's one-token step for the native engine (`native`, `native_episodes`):
the matrices laid out once per call (`DecodeWeights`) and the step itself (`decode_step`),
which does what `DecoderLayer` does (its norms, `grouped_attention`, the same arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models import BuiltinLM
from posttrain.models.layers import grouped_attention, rms_norm


@dataclass
class DecodeWeights:
    """The decoder's matrices laid out for one-token steps, each (in, out) row-major (copies,
    made once per `generate` call). Per layer: q/k/v stacked (H, (nh + 2·nkv)·D) and their
    stacked bias ((nh + 2·nkv)·D,) (Qwen2; None without), the q_norm weight repeated for
    the nh query heads above the k_norm weight for the nkv key heads, (nh + nkv, D) (Qwen3;
    None without: one RMSNorm over all q and k heads then does what the two modules do), o
    (nh·D, H), gate/up stacked (H, 2·I), down (I, H); then lm_head (H, V)."""

    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor] | None
    qk_norm: list[torch.Tensor] | None
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    lm_head: torch.Tensor

    @classmethod
    def of(cls, model: BuiltinLM) -> DecodeWeights | None:
        """None when a projection is not a plain `nn.Linear` (LoRA adapters injected): the
        layers then run as modules."""
        layers = model.model.layers
        linears = [m for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                   layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                   layer.mlp.down_proj)] + [model.lm_head]
        if any(type(m) is not nn.Linear for m in linears):
            return None

        def rows_in(*mods: nn.Linear) -> torch.Tensor:
            return torch.cat([m.weight for m in mods]).t().contiguous()

        def norms_of(attn) -> torch.Tensor:
            q, k = attn.q_norm.weight, attn.k_norm.weight
            return torch.cat([q.expand(attn.num_heads, -1), k.expand(attn.num_kv_heads, -1)])

        qkv = [(x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj) for x in layers]
        return cls(
            qkv=[rows_in(*mods) for mods in qkv],
            qkv_bias=[torch.cat([m.bias for m in mods]) for mods in qkv] if model.config.qkv_bias else None,
            qk_norm=[norms_of(x.self_attn) for x in layers] if model.config.qk_norm else None,
            o=[rows_in(x.self_attn.o_proj) for x in layers],
            gate_up=[rows_in(x.mlp.gate_proj, x.mlp.up_proj) for x in layers],
            down=[rows_in(x.mlp.down_proj) for x in layers],
            lm_head=rows_in(model.lm_head),
        )


def decode_step(
    model: BuiltinLM,
    tok: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None,
    cache,
    weights: DecodeWeights | None = None,
) -> torch.Tensor:
    """One token per row through the model: tok (R,), cos/sin (R, 1, D), mask
    (R, 1, 1, T_kv) bool or None, weights from `DecodeWeights.of` (None: the layers as
    modules) -> next-token logits (R, V). Advances the cache by 1."""
    stack = model.model
    x = stack.embed_tokens(tok[:, None])  # (R, 1, H)
    if weights is None:
        for i, layer in enumerate(stack.layers):
            x = layer(x, cos, sin, mask, False, cache, i)
        cache.advance(1)
        return model.lm_head(stack.norm(x[:, 0]))
    half = cos.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's signs
    for i, layer in enumerate(stack.layers):
        x = decode_layer(layer, x, weights, i, cos, signed_sin, mask, cache)
    cache.advance(1)
    return stack.norm(x[:, 0]) @ weights.lm_head


def decode_layer(layer, x, w: DecodeWeights, i: int, cos, signed_sin, mask, cache) -> torch.Tensor:
    """`DecoderLayer.forward` of layer i for one new token per row, x (R, 1, H) -> (R, 1, H),
    on `DecodeWeights` (fused q/k/v and gate/up; Qwen3's q/k norms, then RoPE, on q and k at
    once)."""
    attn, r = layer.self_attn, x.shape[0]
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = layer.input_layernorm(x) @ w.qkv[i]  # (R, 1, (nh + 2·nkv)·D)
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias[i]
    qkv = qkv.view(r, nh + 2 * nkv, d)
    qk = qkv[:, : nh + nkv]
    if w.qk_norm is not None:  # q_norm and k_norm in one call
        qk = rms_norm(qk, w.qk_norm[i], attn.q_norm.eps)
    qk = qk * cos + qk.roll(d // 2, dims=-1) * signed_sin  # (R, nh + nkv, D)
    k, v = cache.write(i, qk[:, nh:, None], qkv[:, nh + nkv :, None])  # (R, nkv, T_kv, D)
    out = grouped_attention(qk[:, :nh, None], k, v, mask, False)  # (R, nh, 1, D)
    x = x + out.reshape(r, 1, nh * d) @ w.o[i]
    gate, up = (layer.post_attention_layernorm(x) @ w.gate_up[i]).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ w.down[i]
