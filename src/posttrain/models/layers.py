"""Building blocks of the built-in decoder (seed section 一, 1.1-1.6): Llama, Qwen2, Qwen3.

Notation: B batch, T new tokens, T_kv keys (cached + new), H hidden size,
nh query heads, nkv key/value heads (nh % nkv == 0), D head dim, I MLP width.

Departures from the seed's hand-written version, all so that Hugging Face Llama
checkpoints load 1:1 and give the same logits:
- RoPE pairs dimension i with i + D/2 ("rotate half"), not 2i with 2i+1. Both
  are the same rotation up to a fixed permutation of q/k features; HF Llama
  weights are stored for the half-split pairing.
- RMSNorm normalises in float32 and casts back before the weight multiply (as HF).
- Attention uses torch's fused scaled_dot_product_attention and supports grouped
  KV heads (GQA) and a KV cache. Packed documents attend in rows of their own
  (`document_rows.DocumentRows` as the mask), not through one mask over the input row.
- Two switches for the Qwen families: a bias on q/k/v (Qwen2), and an RMSNorm of each
  query and key head over its D features before RoPE (Qwen3's q_norm / k_norm).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain.models.document_rows import DocumentRows

if TYPE_CHECKING:
    from posttrain.models.kv_cache import KVCache


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean_j(x_j^2) + eps), over the last (hidden) dim only.

    Shape: x (..., H) -> (..., H). Statistics are per token; no mean is subtracted.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's arithmetic: x (..., H), weight broadcast against it (H,) -> (..., H)."""
    # float32 statistics keep bf16 training stable; the cast back before the
    # weight multiply matches HF's LlamaRMSNorm bit for bit.
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return weight * (x32 * inv_rms).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Per-pair angular frequencies omega_i = theta^(-2i/D), i = 0..D/2-1, float32 (D/2,).

    scaling: Llama 3.1 frequency scaling (HF rope_type "llama3"): keys `factor`,
    `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`.
    Wavelengths longer than L/low_freq_factor are divided by `factor`, shorter
    than L/high_freq_factor are kept, and the band between is interpolated.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE at arbitrary positions (left padding, packing, cache).

    The angle of pair i at position m is m * omega_i; each angle appears twice,
    for dims i and i + D/2.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        # Not persistent: state dicts stay 1:1 with HF checkpoints.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset_inv_freq(self, device: torch.device | None = None) -> None:
        """Recompute the frequencies (after meta-device construction or a dtype cast)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, T) -> cos, sin (B, T, D) in `dtype`, computed in float32."""
        if self.inv_freq.dtype != torch.float32:  # model.to(bf16) cast the buffer
            self.reset_inv_freq(self.inv_freq.device)
        angles = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: a 90-degree turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their positions: x' = x cos + rotate_half(x) sin.

    q (B, nh, T, D), k (B, nkv, T, D), cos/sin (B, T, D) -> same shapes as q, k.
    Then (R_m q)^T (R_n k) = q^T R_{n-m} k depends on positions only through n - m.
    """
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D): broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, nkv, T, D) -> (B, nkv * n_rep, T, D); KV head j serves query heads j*n_rep .. (j+1)*n_rep-1."""
    if n_rep == 1:
        return x
    b, nkv, t, d = x.shape
    return x[:, :, None].expand(b, nkv, n_rep, t, d).reshape(b, nkv * n_rep, t, d)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with nh/nkv query heads sharing each KV head.

    q (B, nh, T, D), k/v (B, nkv, T_kv, D), mask bool (B, 1, T, T_kv) with
    True = may attend, or None (then `is_causal` says whether to apply the
    top-left causal mask) -> (B, nh, T, D).
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    b, nh, t, d = q.shape
    if t == 1:
        # Decode step: fold each group's n_rep query heads into the query axis so
        # the cached K/V are read once instead of copied n_rep times; the
        # (B, 1, 1, T_kv) mask is the same for every folded row.
        q = q.reshape(b, nh // n_rep, n_rep, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.reshape(b, nh, 1, d)
    # Masked GQA in fused kernels falls back to the math path on CUDA; the copy is cheaper.
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask
    )


class Attention(nn.Module):
    """Multi-head causal self-attention with RoPE, grouped KV heads and an optional cache.

    qkv_bias: q/k/v projections have a bias (Qwen2). qk_norm_eps: given, `q_norm` and
    `k_norm` (RMSNorm over D, weights (D,)) normalise each head of q and k before RoPE (Qwen3).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | DocumentRows | None,
        is_causal: bool,
        cache: KVCache | None = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        """x (B, T, H), cos/sin (B, T, D), mask (B, 1, T, T_kv), DocumentRows (packed
        documents, no cache) or None -> (B, T, H).

        With a cache, the new keys/values are written at the cache's current
        length and attention runs over everything cached so far plus the new tokens.
        """
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, self.num_heads, d)  # (B, T, nh, D)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, d)  # (B, T, nkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, d).transpose(1, 2)  # (B, nkv, T, D)
        q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.write(layer_idx, k, v)  # (B, nkv, T_kv, D)
        if isinstance(mask, DocumentRows):
            rows = grouped_attention(mask.split(q), mask.split(k), mask.split(v), mask.mask, False)  # (R, nh, W, D)
            out = mask.merge(rows, b, t)
        else:
            out = grouped_attention(q, k, v, mask, is_causal)  # (B, nh, T, D)
        # transpose makes it non-contiguous, so reshape (not view) merges the heads
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); x (B, T, H) -> (B, T, H) through width I."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x += attn(norm(x)); x += mlp(norm(x)). (B, T, H) -> (B, T, H).

    Gradient checkpointing (`checkpoint_kwargs` set; `BuiltinLM.gradient_checkpointing_enable`):
    while training with gradients on and no KV cache, the block keeps only its input x and
    runs again in the backward pass (`torch.utils.checkpoint`, same RNG state), giving the
    same numbers. As in transformers, `forward` is what is checkpointed, not `__call__`, so
    module hooks (FSDP2's all-gathers) stay outside and do not run again.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        qkv_bias: bool = False,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.self_attn = Attention(
            hidden_size, num_heads, num_kv_heads, head_dim, qkv_bias, eps if qk_norm else None
        )
        self.mlp = MLP(hidden_size, intermediate_size)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.checkpoint_kwargs: dict | None = None
        """Keyword arguments of `torch.utils.checkpoint.checkpoint`; None = no checkpointing."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | DocumentRows | None,
        is_causal: bool,
        cache: KVCache | None = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        # Never with a cache: the recompute would append this block's keys a second time.
        if self.checkpoint_kwargs is not None and self.training and cache is None and torch.is_grad_enabled():
            return checkpoint(self.block, x, cos, sin, mask, is_causal, None, layer_idx, **self.checkpoint_kwargs)
        return self.block(x, cos, sin, mask, is_causal, cache, layer_idx)

    def block(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | DocumentRows | None,
        is_causal: bool,
        cache: KVCache | None,
        layer_idx: int,
    ) -> torch.Tensor:
        """The block's arithmetic (see the class docstring)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, cache, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))
