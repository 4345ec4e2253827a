"""Tiny models and the built-in tokenizer for the rollout tests (CPU, no downloads)."""

import pytest
import torch

from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinConfig, BuiltinLM

PROMPTS = ["12+3=", "hello world, how are", "a", "7*8="]  # different lengths: left padding


def randomized(seed: int = 0, **overrides) -> BuiltinLM:
    """A 2-layer GQA model over the byte tokenizer with O(1) logits (so greedy has no near-ties)."""
    torch.manual_seed(seed)
    shape = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = BuiltinConfig(
        vocab_size=262,
        num_hidden_layers=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **{**shape, **overrides},
    )
    model = BuiltinLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return model


@pytest.fixture(scope="session")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="session")
def model() -> BuiltinLM:
    """Shared by many tests: do not modify (sync tests build their own)."""
    return randomized()


@pytest.fixture(scope="session")
def hf_model(model, tmp_path_factory):
    """The same weights as `model`, loaded by plain transformers as a LlamaForCausalLM."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
