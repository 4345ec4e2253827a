"""token_logprobs / entropy_from_logits: hand numbers, agreement with the naive
full log-softmax (values and gradients), and bounded memory."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import posttrain.algos.logprobs as logprobs_module
from posttrain.algos import entropy_from_logits, token_logprobs


def naive_logprobs(logits, labels, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1).masked_fill(labels < 0, 0)


def naive_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 2 rows at V = 11, so every call below runs several chunks."""
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 22)


def test_logprob_by_hand():
    # logits = log(1, 2, 5): softmax = (1, 2, 5) / 8, so logp(label 2) = ln(5/8)
    logits = torch.tensor([[[0.0, math.log(2), math.log(5)]]])
    assert token_logprobs(logits, torch.tensor([[2]])).item() == pytest.approx(math.log(5 / 8))
    # temperature 2 takes square roots: p ∝ (1, √2, √5), logp(label 0) = −ln(1 + √2 + √5)
    got = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0).item()
    assert got == pytest.approx(-math.log(1 + math.sqrt(2) + math.sqrt(5)))


def test_seed_ratio_example_from_logprobs():
    # the seed: p_old("很") = 0.5, after an update p_new = 0.6 → ratio exp(ln .6 − ln .5) = 1.2
    old = token_logprobs(torch.tensor([[[math.log(0.5), math.log(0.5)]]]), torch.tensor([[0]]))
    new = token_logprobs(torch.tensor([[[math.log(0.6), math.log(0.4)]]]), torch.tensor([[0]]))
    assert old.item() == pytest.approx(-0.693, abs=1e-3)
    assert new.item() == pytest.approx(-0.511, abs=1e-3)
    assert torch.exp(new - old).item() == pytest.approx(1.2)


def test_entropy_by_hand():
    # uniform over 4 → ln 4; p = (1, 2, 5)/8 → −Σ p ln p
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    p = [1 / 8, 2 / 8, 5 / 8]
    logits = torch.tensor([[[0.0, math.log(2), math.log(5)]]])
    assert entropy_from_logits(logits).item() == pytest.approx(-sum(q * math.log(q) for q in p))
    # a huge temperature flattens any distribution to uniform
    assert entropy_from_logits(logits, temperature=1e6).item() == pytest.approx(math.log(3))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_naive_values_and_gradients(small_chunks, temperature):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 6, 11, generator=gen, requires_grad=True)
    logits = full[:, :-1]  # the caller's shift: a non-contiguous slice
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    labels[1, 3] = -100
    weight = torch.randn(3, 5, generator=gen)

    logp = token_logprobs(logits, labels, temperature)
    ref = naive_logprobs(logits, labels, temperature)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad((logp * weight).sum(), full)
    (ref_grad,) = torch.autograd.grad((ref * weight).sum(), full)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=0)
    assert (grad[1, 3] == 0).all()  # ignored label: no gradient

    entropy = entropy_from_logits(logits, temperature)
    ref = naive_entropy(logits, temperature)
    torch.testing.assert_close(entropy, ref, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad((entropy * weight).sum(), full)
    (ref_grad,) = torch.autograd.grad((ref * weight).sum(), full)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=0)


def test_gradcheck_float64(small_chunks):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 3, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (1, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, 0.8), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, 0.8), (logits,))


def test_bf16_logits_give_float32_results_and_bf16_gradients():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 50, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (2, 4), generator=gen)
    logp = token_logprobs(logits, labels)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, naive_logprobs(logits, labels), atol=1e-5, rtol=0)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="labels"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


class _LargestAllocation(TorchDispatchMode):
    """Records the size of every tensor an op allocates (views excluded)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("fn", ["token_logprobs", "entropy_from_logits"])
def test_no_full_vocab_float32_tensor_is_allocated(monkeypatch, fn):
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 4096)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 64, 512, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 512, (2, 64), generator=gen)
    naive_bytes = logits.numel() * 4  # one float32 (B, T, V) tensor; the naive path makes two
    call = {
        "token_logprobs": lambda: token_logprobs(logits, labels),
        "entropy_from_logits": lambda: entropy_from_logits(logits),
    }[fn]

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with _LargestAllocation() as forward:
            out = call()
    assert max(forward.sizes) <= naive_bytes / 16
    # the graph keeps the logits themselves plus O(B·T) per-row statistics
    kept = sum(t.untyped_storage().nbytes() for t in saved if t.data_ptr() != logits.data_ptr())
    assert kept <= naive_bytes / 64

    with _LargestAllocation() as backward:
        out.sum().backward()
    big = [size for size in backward.sizes if size > naive_bytes / 16]
    assert big == [logits.numel() * logits.element_size()]  # only the gradient itself
