"""Evaluation: sample n completions per prompt, score them with reward functions, report.

    runner = RewardRunner.from_specs(["task_reward"])
    report = evaluate(model, tokenizer, rows, runner, n=8, temperature=1.0, max_new_tokens=256)
    report.metrics["pass@8"], report.metrics["accuracy"]
    report.write("runs/eval")                 # eval.json (metrics + settings), samples.jsonl

`rows` are RL prompt rows (TRL's format): `prompt` (a string, or a list of chat messages,
rendered with the tokenizer's chat template and its generation prompt) plus any columns,
which reach the reward functions as keyword lists, one value per sample. Conversational
prompts get conversational completions (`[{"role": "assistant", "content": ...}]`), as
TRL's GRPOTrainer passes them.

A sample is *correct* when its total reward (the weighted sum the RL trainers optimise)
is at least `correct_threshold` (1.0: a 0/1 verifier said right; partial credit, e.g. from
reasoning-gym, does not count), up to 1e-6 of float32 rounding. With several reward
functions, set the threshold for their weighted sum. Metrics, over all B prompts x n samples:

    accuracy               mean correctness (the mean of pass@1 over prompts, as veRL's
                           `mean@n`)
    pass@k                 Chen et al. 2021's unbiased estimator, averaged over prompts, for
                           k = 1, 2, 4, ... up to n, and n itself
    response_length/mean   generated tokens per sample (the stop token counted), and /max
    truncation_rate        fraction of samples that hit max_new_tokens
    reward/mean, /std, /min, /max        the total reward (std Bessel-corrected)
    reward/<fn>/mean       each function's mean over the samples it scored (None skipped)
    reward/<fn>/errors     samples whose call failed (they got the runner's failure reward)
    num_prompts, num_samples, timing/gen, timing/reward, throughput/tokens_per_s

With `environment` (a per-episode factory, `posttrain.envs`) every sample is a multi-turn
episode (`envs.play_episodes`, under `limits`; `max_new_tokens` is then per model turn):
the reward functions score the whole trajectory and get its environment reward as the
column `env_reward`, `response_length` counts model tokens, and the metrics add
`turns/mean`, `turns/max`, `tool_calls/mean`, `tool/errors`, `tool/timeouts`, `env/errors`,
`env/reward/mean` and `episode/truncated`; each sample record adds `turns` and `tool_calls`.

Where this departs from veRL's validation: veRL reports `mean@n`, `best@n` and `maj@n`
via bootstrap; we report the closed-form pass@k estimate, which has no sampling noise
of its own. With temperature 0 the n samples are identical, so pass@k = accuracy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.envs import merge_episode_metrics, play_episodes
from posttrain.envs.samples import episode_fields
from posttrain.logging import Progress
from posttrain.rewards import RewardResult, RewardRunner, task_reward
from posttrain.rollout import (
    Completions,
    Episodes,
    MultiTurnLimits,
    RolloutEngine,
    SamplingParams,
    engine_kind_for,
    make_engine,
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1).

        pass@k = 1 − C(n−c, k) / C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k/i)

    the product form (the paper's numpy snippet) avoids huge binomials. 1.0 when n − c < k
    (every k-subset holds a correct sample).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two up to n, and n."""
    ks = [2**j for j in range(n.bit_length()) if 2**j <= n]
    return ks if ks[-1] == n else [*ks, n]


def prompt_input(tokenizer: Any, prompt: Any) -> str | list[int]:
    """What an engine takes for one row's prompt: a string as it is (the tokenizer adds BOS);
    a list of chat messages as the token ids of its chat template plus generation prompt."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        # The template writes its own BOS; tokenizing with special tokens would add a second.
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    raise ValueError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


@dataclass
class EvalReport:
    """What `evaluate` found: summary metrics, one record per sample, and the settings used."""

    metrics: dict[str, float]
    """See the module docstring for the names."""
    samples: list[dict[str, Any]]
    """B·n records grouped by prompt: prompt_index, sample_index, prompt, completion,
    answer (when the row has one), reward, rewards ({fn: value}), correct, finish_reason, length;
    an episode's also turns, tool_calls (counts), spans and episode (`envs.samples`)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Sampling and scoring settings (plus whatever the caller adds, e.g. model and data)."""

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write `eval.json` ({"metrics", "settings"}) and `samples.jsonl` into `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"eval": out / "eval.json", "samples": out / "samples.jsonl"}
        summary = {"metrics": self.metrics, "settings": self.settings}
        paths["eval"].write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        with open(paths["samples"], "w", encoding="utf-8") as f:
            for sample in self.samples:
                f.write(json.dumps(sample, ensure_ascii=False, default=str) + "\n")
        return paths

    def table(self) -> str:
        """The metrics as an aligned two-column table, headline numbers first."""
        from posttrain.logging.progress import format_value

        head = ["accuracy", *(k for k in self.metrics if k.startswith("pass@"))]
        keys = head + [k for k in self.metrics if k not in head]
        width = max(map(len, keys), default=0)
        return "\n".join(f"{k:<{width}}  {format_value(self.metrics[k])}" for k in keys)


def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    reward_runner: RewardRunner,
    n: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    engine: str | RolloutEngine | None = None,
    seed: int | None = 0,
    top_p: float = 1.0,
    correct_threshold: float = 1.0,
    progress: bool = False,
    environment: Any = None,
    limits: MultiTurnLimits | None = None,
) -> EvalReport:
    """Sample n completions (or episodes, with `environment`) of every row's prompt, score
    them, and summarise.

    Args:
        rows: dicts with `prompt` (string or chat messages) and any columns for the rewards.
        reward_runner: the reward functions and weights; correctness is judged on its total.
        n: samples per prompt (pass@k is reported up to k = n).
        batch_size: prompts per generate call (each call makes batch_size·n samples).
        engine: an engine name ("native" | "hf" | "vllm"), a built engine, or None for
            `engine_kind_for(model)`.
        seed: the sampling seed of batch i is seed + i, so the same seed and batch_size
            give the same samples; None draws from torch's global RNG.
        correct_threshold: a sample is correct when its total reward is >= this.
        progress: show a progress bar (with ETA) over the batches on stderr.
        environment: a factory of one environment per episode (module docstring); None =
            single-turn completions.
        limits: the episodes' turn and token limits (default `MultiTurnLimits()`).
    """
    if not rows or batch_size < 1:
        raise ValueError(f"evaluate needs at least one row and batch_size >= 1, got {len(rows)} rows, {batch_size}")
    if isinstance(engine, str) or engine is None:
        engine_name = engine or engine_kind_for(model)
        engine = make_engine(engine_name, model, tokenizer)
    else:
        engine_name = type(engine).__name__
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    starts = range(0, len(rows), batch_size)
    samples: list[dict[str, Any]] = []
    errors = dict.fromkeys(reward_runner.names, 0.0)
    timing = {"gen": 0.0, "reward": 0.0}
    episode_parts: list[tuple[int, dict[str, float]]] = []
    with Progress(len(starts), "eval", enabled=progress) as bar:
        for batch, start in enumerate(starts):
            chunk = rows[start : start + batch_size]
            batch_params = dataclasses.replace(params, seed=None if seed is None else seed + batch)
            t0 = time.monotonic()
            out, env_rewards, episode_metrics = _sample(engine, tokenizer, chunk, batch_params, environment, limits)
            if episode_metrics is not None:
                episode_parts.append((len(out), episode_metrics))
            t1 = time.monotonic()
            result = _score(reward_runner, chunk, out, n, env_rewards)
            timing["gen"] += t1 - t0
            timing["reward"] += time.monotonic() - t1
            for name in errors:
                errors[name] += result.metrics.get(f"reward/{name}/errors", 0.0)
            samples += _records(chunk, out, result, n, start, correct_threshold, tokenizer, env_rewards)
            bar.update(1, accuracy=sum(s["correct"] for s in samples) / len(samples))
    metrics = summarize(samples, n, reward_runner.names, errors)
    if episode_parts:
        metrics.update(merge_episode_metrics(episode_parts))
    tokens = sum(s["length"] for s in samples)
    metrics.update({
        "timing/gen": timing["gen"],
        "timing/reward": timing["reward"],
        "throughput/tokens_per_s": tokens / timing["gen"] if timing["gen"] > 0 else math.nan,
    })
    settings = {
        "n": n, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "seed": seed, "engine": engine_name,
        "rewards": reward_runner.names, "reward_weights": reward_runner.weights,
        "correct_threshold": correct_threshold, "num_prompts": len(rows),
    }
    if environment is not None:
        limits = limits or MultiTurnLimits()
        settings.update({"environment": getattr(environment, "__name__", repr(environment)),
                         "max_turns": limits.max_turns, "max_total_tokens": limits.max_total_tokens})
    return EvalReport(metrics, samples, settings)


def _sample(engine: RolloutEngine, tokenizer: Any, chunk: Sequence[Mapping[str, Any]], params: SamplingParams,
            environment: Any, limits: MultiTurnLimits | None):
    """(completions, None, None), or with an environment (episodes, environment rewards (B·n,),
    episode metrics)."""
    if environment is None:
        return engine.generate([prompt_input(tokenizer, r["prompt"]) for r in chunk], params), None, None
    return play_episodes(engine, [dict(r) for r in chunk], environment, params, limits or MultiTurnLimits())


def _score(runner: RewardRunner, chunk: Sequence[Mapping[str, Any]], out: Completions | Episodes, n: int,
           env_rewards: torch.Tensor | None = None) -> RewardResult:
    """Score B·n completions; every non-prompt column is repeated n times, aligned with them.
    Episodes: their environment rewards are the column `env_reward`, their ids the whole
    trajectory's."""
    keys = list(dict.fromkeys(k for row in chunk for k in row if k != "prompt"))
    columns = {k: [row.get(k) for row in chunk for _ in range(n)] for k in keys}
    if env_rewards is not None:
        columns["env_reward"] = [None if math.isnan(r) else r for r in env_rewards.tolist()]
    prompts = [row["prompt"] for row in chunk for _ in range(n)]
    completions: list[Any] = [
        text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
        for prompt, text in zip(prompts, out.texts)
    ]
    lengths = out.total_lengths if isinstance(out, Episodes) else out.lengths
    ids = [out.response_ids[i, :length].tolist() for i, length in enumerate(lengths.tolist())]
    return runner.score(prompts, completions, ids, columns)


def _records(
    chunk: Sequence[Mapping[str, Any]],
    out: Completions | Episodes,
    result: RewardResult,
    n: int,
    offset: int,
    threshold: float,
    tokenizer: Any,
    env_rewards: torch.Tensor | None,
) -> list[dict[str, Any]]:
    """One sample record (see `EvalReport.samples`) per completion of a batch; an episode's
    also holds its `spans` and `episode` (`envs.samples.episode_fields`)."""
    records = []
    for i, (text, length, reason) in enumerate(zip(out.texts, out.lengths.tolist(), out.finish_reason)):
        row = chunk[i // n]
        reward = float(result.total[i])
        record = {
            "prompt_index": offset + i // n,
            "sample_index": i % n,
            "prompt": row["prompt"],
            "completion": text,
            **({"answer": row["answer"]} if "answer" in row else {}),
            "reward": reward,
            "rewards": {name: values[i] for name, values in result.per_function.items()},
            "correct": reward >= threshold - 1e-6,  # total is float32: 0.7 + 0.3 may land below 1
            "finish_reason": reason,
            "length": length,
        }
        if isinstance(out, Episodes):
            record["turns"] = int(out.turns[i])
            record["tool_calls"] = sum(int(info.get("tool_calls", 0)) for info in out.infos[i])
            env_reward = None if env_rewards is None or math.isnan(env_rewards[i]) else float(env_rewards[i])
            record.update(episode_fields(tokenizer, out, i, env_reward))
        records.append(record)
    return records


def summarize(
    samples: Sequence[Mapping[str, Any]],
    n: int,
    reward_names: Sequence[str],
    errors: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Accuracy, pass@k, lengths, truncation and reward statistics of B·n sample records
    (grouped by prompt, as `evaluate` makes them); `errors` gives `reward/<fn>/errors`.
    See the module docstring for the names."""
    total = len(samples)
    if total == 0:
        raise ValueError("no samples to summarize (no rows to evaluate?)")
    correct = [bool(s["correct"]) for s in samples]
    rewards = [float(s["reward"]) for s in samples]
    lengths = [int(s["length"]) for s in samples]
    metrics: dict[str, float] = {"accuracy": sum(correct) / total}
    groups = [correct[i : i + n] for i in range(0, total, n)]
    for k in pass_at_k_values(n):
        metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(g), k) for g in groups) / len(groups)
    mean = sum(rewards) / total
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (total - 1)) if total > 1 else 0.0
    metrics.update({
        "response_length/mean": sum(lengths) / total,
        "response_length/max": float(max(lengths)),
        "truncation_rate": sum(s["finish_reason"] == "length" for s in samples) / total,
        "reward/mean": mean,
        "reward/std": std,
        "reward/min": min(rewards),
        "reward/max": max(rewards),
    })
    for name in reward_names:
        given = [s["rewards"][name] for s in samples if s["rewards"].get(name) is not None]
        metrics[f"reward/{name}/mean"] = sum(given) / len(given) if given else math.nan
        if errors is not None:
            metrics[f"reward/{name}/errors"] = float(errors.get(name, 0.0))
    metrics.update({"num_prompts": float(len(groups)), "num_samples": float(total)})
    return metrics


def evaluate_task(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    task: str,
    max_new_tokens: int = 64,
    batch_size: int = 64,
    temperature: float = 0.0,
    environment: Any = None,
    limits: MultiTurnLimits | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy (by default) completions of `rows[i]["prompt"]`, scored by the task's scorer
    (a bundled task or `rg:<name>`, through `task_reward`): the SFT trainer's eval. With
    `environment`, episodes (as `evaluate`), scored on the whole trajectory.

    Returns metrics `accuracy`, `response_length/mean`, `truncation_rate` (and the episode
    metrics with an environment), and one sample dict per row (prompt, completion, answer, score).
    """
    runner = RewardRunner([("task_reward", task_reward(task=task))], timeout_s=60.0)
    report = evaluate(
        model, tokenizer, rows, runner, n=1, temperature=temperature,
        max_new_tokens=max_new_tokens, batch_size=batch_size, seed=None, environment=environment, limits=limits,
    )
    keys = ["accuracy", "response_length/mean", "truncation_rate"]
    keys += [k for k in ("turns/mean", "tool_calls/mean", "tool/errors", "episode/truncated") if k in report.metrics]
    metrics = {k: report.metrics[k] for k in keys}
    samples = [
        {"prompt": s["prompt"], "completion": s["completion"], "answer": s.get("answer"), "score": s["rewards"]["task_reward"]}
        for s in report.samples
    ]
    return metrics, samples


def task_eval(model: torch.nn.Module, tokenizer: Any, rows: Sequence[Mapping[str, Any]], cfg: Any):
    """Held-out task accuracy for a trainer's `eval` section (`task`, `num_examples`,
    `max_new_tokens`, `batch_size`): metrics prefixed `eval/` and the samples."""
    metrics, samples = evaluate_task(
        model, tokenizer, rows[: cfg.num_examples], cfg.task, cfg.max_new_tokens, cfg.batch_size
    )
    return {f"eval/{k}": v for k, v in metrics.items()}, samples
