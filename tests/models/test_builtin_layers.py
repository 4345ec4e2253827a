"""Components of the built-in decoder against hand-computed values."""

import math

import pytest
import torch

from posttrain.models.layers import (
    MLP,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    grouped_attention,
    repeat_kv,
    rope_inv_freq,
)


def test_rmsnorm_hand_example():
    norm = RMSNorm(2, eps=0.0)
    norm.weight.data = torch.tensor([1.0, 2.0])
    # mean(x^2) = (9 + 16) / 2 = 12.5, rms = 3.5355339; y = [3, 4] / rms * [1, 2]
    y = norm(torch.tensor([[[3.0, 4.0]]]))
    assert torch.allclose(y, torch.tensor([[[0.8485281, 2.2627417]]]), atol=1e-6)


def test_rmsnorm_eps_keeps_zero_vector_finite():
    y = RMSNorm(4, eps=1e-6)(torch.zeros(1, 1, 4))
    assert torch.equal(y, torch.zeros(1, 1, 4))


def test_rope_frequencies_hand_example():
    # D = 4, theta = 100: omega_i = 100^(-2i/4) for i = 0, 1 -> [1, 0.1]
    assert torch.allclose(rope_inv_freq(4, 100.0), torch.tensor([1.0, 0.1]))


def test_llama3_scaling_hand_example():
    # D = 4, omega_1 = theta^(-1/2); choose theta so omega_1 = 2*pi/32 (wavelength 32).
    # L = 64: wavelengths > 64/1 are divided by 8, < 64/4 = 16 kept, between: smooth
    # s = (64/32 - 1) / (4 - 1) = 1/3 -> omega * ((1 - s)/8 + s) = omega * 10/24.
    omega = 2 * math.pi / 32
    scaling = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    got = rope_inv_freq(4, omega**-2, scaling)
    assert torch.allclose(got, torch.tensor([1.0, omega * 10 / 24]))
    # theta = 10000: omega = [1 (wavelength 6.3: kept), 0.01 (wavelength 628: / 8)]
    assert torch.allclose(rope_inv_freq(4, 10000.0, scaling), torch.tensor([1.0, 0.01 / 8]))


def rope_at(x: torch.Tensor, position: int, rope: RotaryEmbedding) -> torch.Tensor:
    cos, sin = rope(torch.tensor([[position]]), torch.float32)
    return apply_rope(x, x, cos, sin)[0]


def test_rope_keeps_shape_and_norm_and_is_identity_at_zero():
    rope = RotaryEmbedding(8, 10000.0)
    q = torch.randn(2, 3, 5, 8)
    cos, sin = rope(torch.arange(5)[None].expand(2, 5), torch.float32)
    q_rot, k_rot = apply_rope(q, q[:, :1], cos, sin)
    assert q_rot.shape == q.shape and k_rot.shape == (2, 1, 5, 8)
    assert torch.allclose(q_rot.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.allclose(q_rot[:, :, 0], q[:, :, 0])


def test_rope_score_depends_only_on_offset():
    rope = RotaryEmbedding(8, 10000.0)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 8, generator=gen)

    def score(m, n):
        return (rope_at(q, m, rope) * rope_at(k, n, rope)).sum()

    assert torch.allclose(score(2, 5), score(10, 13), atol=1e-5)
    assert torch.allclose(score(7, 3), score(104, 100), atol=1e-4)
    assert not torch.allclose(score(2, 5), score(2, 6), atol=1e-3)


def reference_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(D) masked) v written out; allowed (T, T_kv) or (B, 1, T, T_kv)."""
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_grouped_attention_matches_formula(num_kv_heads):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k, v = torch.randn(2, 2, num_kv_heads, 5, 8, generator=gen)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    expected = reference_attention(q, k, v, causal)
    assert torch.allclose(grouped_attention(q, k, v, None, True), expected, atol=1e-5)
    padded = causal[None, None] & torch.tensor([[0, 1, 1, 1, 1], [1] * 5]).bool()[:, None, None]
    padded[0, 0, 0, 0] = True  # keep the all-padding query row finite in the reference
    expected = reference_attention(q, k, v, padded)
    assert torch.allclose(grouped_attention(q, k, v, padded, False), expected, atol=1e-5)
    # one query over five keys: the decode path that folds query heads
    last = padded[:, :, -1:]
    expected = reference_attention(q[:, :, -1:], k, v, last)
    assert torch.allclose(grouped_attention(q[:, :, -1:], k, v, last, False), expected, atol=1e-5)


def test_swiglu_formula():
    mlp = MLP(3, 5)
    x = torch.randn(2, 4, 3)
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    expected = (gate * torch.sigmoid(gate) * up) @ mlp.down_proj.weight.T
    assert torch.allclose(mlp(x), expected, atol=1e-6)
