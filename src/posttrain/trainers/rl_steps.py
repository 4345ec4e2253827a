"""The pieces of one RL step that the driver (`trainers/rl.py`) calls: prompt data,
rollout collection with DAPO's dynamic sampling, advantage estimators, metrics, timing,
and what a checkpoint of an RL run holds.

Notation: B rows, n responses per prompt, Tr response tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.algos import filter_groups, masked_mean, masked_sum, masked_whiten
from posttrain.config.core import ConfigError
from posttrain.config.rl import AlgorithmConfig, RLDataConfig
from posttrain.data.formats import validate_rows
from posttrain.data.sources import load_rows
from posttrain.logging import get_logger
from posttrain.rollout.base import left_pad, pad_id_of
from posttrain.trainers.core import merge_metrics
from posttrain.workers import Reward, RLBatch

log = get_logger(__name__)

STAGES = ("gen", "reward", "old_logprob", "ref", "values", "adv", "update_critic", "update_actor")
NOT_RUN = {
    "policy_loss": 0.0, "clip_frac": 0.0, "clip_frac/low": 0.0, "clip_frac/high": 0.0,
    "approx_kl": 0.0, "ratio/mean": 1.0, "entropy": 0.0, "grad_norm": 0.0, "value_loss": 0.0, "kl": 0.0,
    "advantage/mean": 0.0,
}
"""Values of the per-step metrics whose stage did not run this step (no critic, critic
warmup, no reference): every RL metric is in every line of metrics.jsonl, never NaN."""
ROLLOUT_LOGPROB_TOL = 1e-3


def step_seed(seed: int, step: int, salt: int) -> int:
    """A seed for one use in one step (generation round `salt`, shuffling, …): the same on
    a resumed run as on an uninterrupted one."""
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**62)


# ----------------------------------------------------------------------------- prompts


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a prompt: a string with the tokenizer's special tokens (BOS), or chat
    messages through the chat template with the generation prompt."""
    if isinstance(prompt, list):
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def load_prompts(source: Any, tokenizer: Any, cfg: RLDataConfig) -> tuple[list[dict], dict[str, float]]:
    """Read, validate and tokenize prompt rows → examples {ids, prompt, columns} and counts.

    Too-long prompts follow `data.truncation` (error naming the row, keep the last
    tokens, or drop); counts go to the metrics as data/*. A column missing from some rows
    is None there (reward functions get every column for every row, as TRL)."""
    rows = load_rows(source)
    if cfg.prompt_key != "prompt":
        missing = [i for i, r in enumerate(rows) if cfg.prompt_key not in r]
        if missing:
            raise ConfigError(f"data.prompt_key: {rows.locate(missing[0])} has no column {cfg.prompt_key!r}")
        for r in rows:
            r["prompt"] = r.pop(cfg.prompt_key)
    validate_rows(rows, "prompt", rows.name)
    examples, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        ids = encode_prompt(tokenizer, row["prompt"])
        if len(ids) > cfg.max_prompt_length:
            if cfg.truncation == "error":
                raise ConfigError(
                    f"data.max_prompt_length: the prompt of {rows.locate(i)} has {len(ids)} tokens, more "
                    f"than {cfg.max_prompt_length}; raise it or set data.truncation=left|drop")
            if cfg.truncation == "drop":
                dropped += 1
                continue
            ids, truncated = ids[-cfg.max_prompt_length :], truncated + 1
        columns = {k: v for k, v in row.items() if k != "prompt"}
        examples.append({"ids": ids, "prompt": row["prompt"], "columns": columns})
    if not examples:
        raise ConfigError(f"data.train_files: no prompt left in {rows.name} (all {dropped} dropped as too long)")
    keys = list(dict.fromkeys(k for e in examples for k in e["columns"]))  # every batch gets every column
    for e in examples:
        e["columns"] = {k: e["columns"].get(k) for k in keys}
    stats = {"data/n_rows": float(len(rows)), "data/n_truncated": float(truncated), "data/n_dropped": float(dropped)}
    return examples, stats


def collate_prompts(examples: Sequence[dict], pad_id: int) -> RLBatch:
    """Examples → an RLBatch holding only prompts (left-padded), raw prompts and columns."""
    ids, mask = left_pad([e["ids"] for e in examples], pad_id)
    columns = {k: [e["columns"][k] for e in examples] for k in examples[0]["columns"]}
    return RLBatch(prompt_ids=ids, prompt_mask=mask, prompts=[e["prompt"] for e in examples], columns=columns)


def prompt_collator(tokenizer: Any) -> Callable[[Sequence[dict]], RLBatch]:
    pad = pad_id_of(tokenizer)
    return lambda examples: collate_prompts(examples, pad)


# ----------------------------------------------------------------------------- timing


class StageTimer:
    """Wall time per stage of a step (veRL's timing/* metrics); every stage reports, 0 if it did not run."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}


# ----------------------------------------------------------------------------- rollouts


def collect_rollouts(
    next_prompts: Callable[[], RLBatch],
    generate: Callable[[RLBatch, int], RLBatch],
    reward: Reward,
    algo: AlgorithmConfig,
    batch_size: int,
    n: int,
    timer: StageTimer,
) -> tuple[RLBatch, dict[str, float]]:
    """Generate and score `batch_size` prompts × n, or, with `algo.filter_groups` (DAPO
    dynamic sampling), keep generating until `batch_size` groups whose scores are not all
    equal are kept, for at most `algo.max_gen_batches` rounds; then train on what was kept
    (the last round's batch if nothing was), with a warning.

    `generate(prompts, round)` samples; the metrics cover every generated row."""
    kept: list[RLBatch] = []
    generated: list[tuple[RLBatch, dict[str, float]]] = []
    rounds = algo.max_gen_batches if algo.filter_groups else 1
    for r in range(rounds):
        prompts = next_prompts()
        with timer("gen"):
            batch = generate(prompts, r)
        with timer("reward"):
            batch, reward_metrics = reward.score(batch)
        generated.append((batch, reward_metrics))
        keep = filter_groups(batch.scores, n).repeat_interleave(n) if algo.filter_groups else None
        kept.append(batch if keep is None else batch.select(keep))
        if sum(map(len, kept)) >= batch_size * n:
            break
    train = RLBatch.concat(kept)
    if algo.filter_groups and len(train) < batch_size * n:
        log.warning("dynamic sampling kept %d of %d groups after %d generation rounds "
                    "(algorithm.max_gen_batches); training on those", len(train) // n, batch_size, rounds)
        if not len(train):
            train = generated[-1][0]
    train = train.select(range(min(len(train), batch_size * n)))
    metrics = generation_metrics([b for b, _ in generated], [m for _, m in generated], n)
    metrics["dynamic_sampling/gen_batches"] = float(len(generated))
    metrics["dynamic_sampling/kept_frac"] = sum(map(len, kept)) / sum(len(b) for b, _ in generated)
    return train, metrics


def generation_metrics(batches: list[RLBatch], reward_metrics: list[dict[str, float]], n: int) -> dict[str, float]:
    """Rewards, accuracy, lengths and truncation over every generated row of the step."""
    b = RLBatch.concat(batches)
    merged = merge_metrics([(len(x), m) for x, m in zip(batches, reward_metrics)])
    for key in merged:
        if key.endswith("/errors"):
            merged[key] = sum(m.get(key, 0.0) for m in reward_metrics)
    total, lengths = b.rewards["total"], b.lengths.float()
    merged.update({
        "reward/mean": float(total.mean()),
        "reward/std": float(total.std()) if len(total) > 1 else 0.0,
        "accuracy": float(b.rewards["correct"].mean()),
        "score/mean": float(b.scores.mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "truncation_rate": float(b.truncated.float().mean()),
        "zero_std_group_frac": float((~filter_groups(b.scores, n)).float().mean()) if n > 1 else 0.0,
    })
    for name, values in b.rewards.items():
        if name not in ("total", "correct"):
            valid = values[~values.isnan()]
            merged[f"reward/{name}/mean"] = float(valid.mean()) if len(valid) else 0.0
    return merged


def mask_truncated(batch: RLBatch) -> RLBatch:
    """Remove truncated responses from the loss (their scores still count in group baselines)."""
    return batch.replace(response_mask=batch.response_mask * (~batch.truncated).long()[:, None])


# ----------------------------------------------------------------------------- advantages


def _outcome(batch: RLBatch) -> torch.Tensor:
    """(B,) sequence reward: the score, minus the summed KL penalty when it is in the reward
    (summed over generated tokens: a row masked out of the loss keeps its score in the group)."""
    return masked_sum(batch.token_rewards, batch.generated_mask, dim=-1)


def _check_groups(batch: RLBatch, n: int) -> None:
    uid = batch.uid.view(-1, n)
    if not bool((uid == uid[:, :1]).all()):
        raise RuntimeError("rows of a group are not contiguous: a group estimator would mix prompts")


def compute_advantages(batch: RLBatch, algo: AlgorithmConfig, n: int) -> tuple[RLBatch, dict[str, float]]:
    """Advantages (and GAE returns) by `algo.adv_estimator` (`posttrain.algos.ADV_ESTIMATORS`),
    whitened when `algo.whiten` unless the estimator whitens its output itself."""
    est = algo.estimator
    if est.grouped:
        _check_groups(batch, n)
    mask = batch.response_mask
    adv, returns = est.fn(_outcome(batch), batch.token_rewards, batch.values, mask,
                          group_size=n, gamma=algo.gamma, lam=algo.lam, scale=algo.grpo_scale)
    if algo.whiten and not est.whitens:
        adv = masked_whiten(adv, mask)
    metrics = {"advantage/mean": float(masked_mean(adv, mask))}
    if returns is not None:
        metrics["returns/mean"] = float(masked_mean(returns, mask))
    return batch.replace(advantages=adv, returns=returns), metrics


# ----------------------------------------------------------------------------- checkpoints


class RunModels:
    """What `save_checkpoint` / `save_final` write: the policy at the top of the folder
    (HF format, as every trainer), the critic in `critic/` (a ScalarHeadModel checkpoint)
    with its optimizer state in `critic/optimizer.pt`, and a LoRA adapter in `adapter/`."""

    CRITIC = "critic"
    CRITIC_STATE = "optimizer.pt"

    def __init__(self, policy: torch.nn.Module, critic: Any = None, adapter: torch.nn.Module | None = None,
                 with_optimizer: bool = True):
        self.policy, self.critic, self.adapter = policy, critic, adapter
        self.with_optimizer = with_optimizer

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.policy.save_pretrained(directory)
        if self.adapter is not None:
            self.adapter.save_pretrained(directory / "adapter")
        if self.critic is None:
            return
        self.critic.model.save_pretrained(directory / self.CRITIC)
        if self.with_optimizer and self.critic.optimizer is not None:
            torch.save({"optimizer": self.critic.optimizer.state_dict(),
                        "scheduler": self.critic.scheduler.state_dict(), "steps": self.critic.steps},
                       directory / self.CRITIC / self.CRITIC_STATE)

    @classmethod
    def load_critic(cls, checkpoint: Path, critic: Any) -> None:
        """Restore the critic's weights (and optimizer, schedule) saved by `save_pretrained`."""
        from posttrain.checkpoint import load_weights

        load_weights(checkpoint / cls.CRITIC, critic.model)
        state_file = checkpoint / cls.CRITIC / cls.CRITIC_STATE
        if critic.optimizer is not None:
            state = torch.load(state_file, map_location="cpu", weights_only=True)
            critic.optimizer.load_state_dict(state["optimizer"])
            critic.scheduler.load_state_dict(state["scheduler"])
            critic.steps = state["steps"]
