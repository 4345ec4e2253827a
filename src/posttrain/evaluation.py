"""Task evaluation: generate completions for held-out prompts and score them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.data.tasks import get_task


def engine_kind_for(model: torch.nn.Module) -> str:
    """`native` for the built-in model (peft-wrapped or not), `hf` for anything else."""
    from posttrain.models import BuiltinLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "native" if isinstance(base, BuiltinLM) else "hf"


def evaluate_task(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    task: str,
    max_new_tokens: int = 64,
    batch_size: int = 64,
    temperature: float = 0.0,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy (by default) completions of `rows[i]["prompt"]`, scored by the task's scorer.

    Returns metrics `accuracy`, `response_length/mean`, `truncation_rate`, and one sample
    dict per row (prompt, completion, answer, score).
    """
    from posttrain.rollout import SamplingParams, make_engine

    scorer = get_task(task)
    engine = make_engine(engine_kind_for(model), model, tokenizer)
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens)
    samples, lengths, truncated = [], [], 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        out = engine.generate([r["prompt"] for r in chunk], params)
        for row, text, length, reason in zip(chunk, out.texts, out.lengths.tolist(), out.finish_reason):
            score = scorer.score(text, str(row["answer"]), **{k: v for k, v in row.items() if k not in ("answer",)})
            samples.append({"prompt": row["prompt"], "completion": text, "answer": row["answer"], "score": score})
            lengths.append(length)
            truncated += reason == "length"
    n = max(len(samples), 1)
    metrics = {
        "accuracy": sum(s["score"] for s in samples) / n,
        "response_length/mean": sum(lengths) / n,
        "truncation_rate": truncated / n,
    }
    return metrics, samples
