"""A word-level tokenizer over a handful of words and tiny built-in models (CPU, no downloads)."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from posttrain.models import BuiltinLM

WORDS = "a b c d e f g h".split()


def word_tokenizer() -> PreTrainedTokenizerFast:
    """ids 0 <pad>, 1 <bos>, 2 <eos>, then one per word; a BOS starts every encoding."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def tiny_model(vocab_size: int, seed: int = 0) -> BuiltinLM:
    torch.manual_seed(seed)
    return BuiltinLM.from_preset(
        "tiny", vocab_size=vocab_size, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


@pytest.fixture
def tok():
    return word_tokenizer()


@pytest.fixture
def model(tok):
    return tiny_model(len(tok))


def prompt_batch(tok, prompts, columns=None):
    """An RLBatch holding prompts only, as the trainer's prompt stream makes them."""
    from posttrain.data.prompts import encode_prompt
    from posttrain.workers import RLBatch

    examples = [{"ids": encode_prompt(tok, p), "prompt": p, "columns": {k: v[i] for k, v in (columns or {}).items()}}
                for i, p in enumerate(prompts)]
    return RLBatch.from_prompts(examples, tok.pad_token_id)


def rollout(model, tok, n=4, max_new_tokens=4, prompts=("a b", "c", "d e f g"), seed=0):
    """A sampled RLBatch (n responses per prompt) from `model`."""
    from posttrain.rollout import SamplingParams, make_engine
    from posttrain.workers import Rollout

    worker = Rollout(make_engine("native", model, tok), SamplingParams(n=n, max_new_tokens=max_new_tokens))
    return worker.generate(prompt_batch(tok, list(prompts)), seed=seed)
