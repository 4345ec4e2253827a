"""Shared tiny models for the models tests (a few thousand parameters, CPU, no downloads)."""

import pytest
import torch

from posttrain.models import BuiltinConfig, BuiltinLM

TINY = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights large enough that logits are O(1), so a wrong formula cannot hide below 1e-4."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return model


@pytest.fixture
def tiny_lm() -> BuiltinLM:
    """GQA (nh 4, nkv 2), tied embeddings, randomized weights."""
    torch.manual_seed(0)
    return randomize_(BuiltinLM(BuiltinConfig(**TINY))).eval()


@pytest.fixture(scope="session")
def tiny_kwargs() -> dict:
    """BuiltinConfig fields of the tiny test model (do not mutate: copy with {**tiny_kwargs})."""
    return dict(TINY)


@pytest.fixture(scope="session")
def randomize():
    """randomize_(model, seed=0) -> model with O(1)-logit weights."""
    return randomize_
