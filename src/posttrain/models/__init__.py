"""Models: the built-in Llama-compatible decoder and loading of local HF causal LMs."""

from posttrain.models.builtin import PRESETS, BuiltinConfig, BuiltinLM, next_token_loss
from posttrain.models.kv_cache import KVCache
from posttrain.models.loading import forward_logits, load_causal_lm, resolve_device, resolve_dtype

__all__ = [
    "PRESETS",
    "BuiltinConfig",
    "BuiltinLM",
    "KVCache",
    "forward_logits",
    "load_causal_lm",
    "next_token_loss",
    "resolve_device",
    "resolve_dtype",
]
