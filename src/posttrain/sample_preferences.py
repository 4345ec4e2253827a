"""Preference pairs sampled from a model: the sampling half of `posttrain data make-preferences --model`.

    sample_preferences("arithmetic", "data/arith_dpo", "runs/sft/final", samples=8)

Loads the local model (native engine for the checkpoints the built-in model runs: Llama, Qwen2,
Qwen3, Mistral; else transformers' generate), samples `samples` completions per prompt at temperature 1 and hands
them to `data.make_preferences`, which scores them, keeps a right and a wrong one per prompt
and writes the files (see its module doc: which prompts, which pair, what is counted).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from posttrain.config import ModelConfig
from posttrain.data.make_preferences import Sample, make_preferences
from posttrain.models.factory import build_model_and_tokenizer
from posttrain.rollout import RolloutEngine, SamplingParams, engine_kind_for, make_engine


def load_engine(model_path: str) -> RolloutEngine:
    """The rollout engine over the local model at `model_path`, in eval mode."""
    model, tokenizer = build_model_and_tokenizer(ModelConfig(path=model_path))
    return make_engine(engine_kind_for(model.eval()), model, tokenizer)


def engine_sampler(load: Callable[[], RolloutEngine], samples: int, max_new_tokens: int, seed: int) -> Sample:
    """A `Sample` drawing `samples` completions per prompt at temperature 1 from `load()`'s
    engine. The engine is loaded on the first call, so make_preferences checks its arguments
    before anything heavy runs; call i is seeded seed · 1_000_003 + i, so a run repeats
    exactly and no two calls share a seed."""
    engine: RolloutEngine | None = None
    calls = 0

    def sample(prompts: list[str]) -> list[list[tuple[str, str]]]:
        nonlocal engine, calls
        if engine is None:
            engine = load()
        params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=max_new_tokens,
                                seed=seed * 1_000_003 + calls)
        calls += 1
        gen = engine.generate(prompts, params)
        done = list(zip(gen.texts, gen.finish_reason, strict=True))
        return [done[i * samples : (i + 1) * samples] for i in range(len(prompts))]

    return sample


def sample_preferences(
    task: str,
    out_dir: str | Path,
    model: str,
    n_train: int = 5000,
    n_test: int = 500,
    seed: int = 0,
    samples: int = 8,
    max_new_tokens: int = 64,
    **kwargs: Any,
) -> dict[str, Any]:
    """Write pairs sampled from the model at `model` for `task` into `out_dir`.

    `samples` (K >= 2) completions per prompt of at most `max_new_tokens` tokens. kwargs go
    to `make_preferences`: batch_size, max_prompts_factor and the task's options. Returns
    make_preferences' result, with "counts" (prompts tried, all right, all wrong).
    """
    if samples < 2:
        raise ValueError(f"need samples >= 2 (a right and a wrong one), got {samples}")
    sample = engine_sampler(partial(load_engine, model), samples, max_new_tokens, seed)
    return make_preferences(task, out_dir, n_train, n_test, seed, sample=sample,
                            sample_meta={"model": model, "samples": samples}, **kwargs)
