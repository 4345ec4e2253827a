"""Rollout engines: sample completions (with their logprobs) from the current policy.

    engine = make_engine("native", model, tokenizer)        # or "hf", "vllm"
    out = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=256))
    out.response_ids, out.response_mask, out.logprobs        # (B·n, T_resp) each
    engine.sync_weights(model)                               # after each policy update

Engines (one interface, `RolloutEngine`; config key `rollout.engine`):
- native: batched KV-cache decoding of the built-in model (Llama, Qwen2, Qwen3 and Mistral
  checkpoints, and transformers models of those families) in eager PyTorch; finished rows
  leave the batch. The default on CPU and for the demo.
- hf: transformers' `generate`, for any transformers causal LM (`model_impl_for`: under it,
  model.impl=auto loads a checkpoint with transformers).
- vllm: a vLLM engine with in-place weight sync (optional extra: CUDA, or vLLM's CPU build), or
  with `server_url=` a vLLM server that `posttrain vllm-serve` started (`vllm_server.py`: TRL's
  server mode; no vLLM needed in this process), weights pushed to it over a process group.
All three return the same `Completions`, whose logprobs are log softmax(logits / T)
of the sampled tokens (see base.py). `generate(..., on_tokens=f)` calls f with each
step's new tokens as they are decoded (vllm: replayed after the call); `TextStream`
turns them into text (`posttrain serve` streams it).

Multi-turn episodes (episodes.py): `engine.generate_episodes(prompts, params, limits,
handler)` (every engine: native and hf token by token, vllm turn by turn) lets a
`TurnHandler` (an environment, `posttrain.envs`) answer each model turn; the trajectory
comes back as one response whose `response_mask` is 0 on the environment's tokens.
Native and hf also play them in parts: `play = engine.start_episodes(...)`, then
`engine.advance(play, tokens, version)` until it says done, the weights free to change between
calls (partial rollouts), and `play.episodes()`.
"""

from __future__ import annotations

from torch import nn

from posttrain.rollout.base import (
    Completions,
    Prompts,
    RolloutEngine,
    SamplingParams,
    TextStream,
    TokenCallback,
)
from posttrain.rollout.episodes import Episodes, MultiTurnLimits, Reply, TurnHandler
from posttrain.rollout.sampling import filter_logits, sample_next


def _native(model, tokenizer, **opts):
    from posttrain.rollout.native import NativeEngine

    return NativeEngine(model, tokenizer, **opts)


def _hf(model, tokenizer, **opts):
    from posttrain.rollout.hf import HFEngine

    return HFEngine(model, tokenizer, **opts)


def _vllm(model, tokenizer, **opts):
    if "server_url" in opts:  # server mode: a `posttrain vllm-serve` server
        from posttrain.rollout.vllm_server import VLLMServerEngine

        return VLLMServerEngine(model, tokenizer, **opts)
    from posttrain.rollout.vllm import VLLMEngine

    return VLLMEngine(model, tokenizer, **opts)


ENGINES = {"native": _native, "hf": _hf, "vllm": _vllm}
"""Engine constructors by name (the valid values of `rollout.engine`)."""


def engine_kind_for(model: nn.Module) -> str:
    """`native` for the built-in model (peft-wrapped or not), `hf` for anything else."""
    from posttrain.models import BuiltinLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "native" if isinstance(base, BuiltinLM) else "hf"


def model_impl_for(engine: str, impl: str) -> str:
    """The model implementation (`model.impl`) to load a policy with for rollout engine `engine`:
    `auto` becomes `hf` under the hf engine, whose `generate` needs a transformers model (what a
    TRL user's run holds); `auto` otherwise picks the built-in model where it can
    (`load_causal_lm`). An explicit impl stays."""
    return "hf" if engine == "hf" and impl == "auto" else impl


def make_engine(kind: str, model: nn.Module, tokenizer, **opts) -> RolloutEngine:
    """Build the rollout engine `kind` ("native" | "hf" | "vllm") over `model`.

    opts go to the engine: native: compact_fraction, max_batch_size; hf: none;
    vllm: model_path, dtype, gpu_memory_utilization, cpu_kvcache_space_gb, seed and any
    `vllm.LLM` argument; or server_url (server mode), timeout_s, bucket_mb.
    """
    if kind not in ENGINES:
        raise ValueError(f"unknown rollout engine {kind!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[kind](model, tokenizer, **opts)


__all__ = [
    "ENGINES",
    "Completions",
    "Episodes",
    "MultiTurnLimits",
    "Prompts",
    "Reply",
    "RolloutEngine",
    "SamplingParams",
    "TextStream",
    "TokenCallback",
    "TurnHandler",
    "engine_kind_for",
    "filter_logits",
    "make_engine",
    "model_impl_for",
    "sample_next",
]
