"""The stages of one RL step that the driver (`trainers/rl.py`) calls: rollout collection
with DAPO's dynamic sampling, the step's generation metrics, truncation masking, the rollout
correction, and the advantage stage (the estimators themselves are `algos.advantages`).

Notation: B rows, n responses per prompt, Tr response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from posttrain.algos import (
    filter_groups,
    masked_mean,
    masked_sum,
    masked_whiten,
    rollout_correction,
)
from posttrain.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from posttrain.envs import merge_episode_metrics
from posttrain.logging import get_logger
from posttrain.logging.timing import StageTimer
from posttrain.training.core import merge_metrics
from posttrain.workers import Reward, RLBatch

log = get_logger(__name__)

STAGES = ("gen", "reward", "old_logprob", "ref", "values", "adv", "update_critic", "update_actor")
CRITIC_STAGES = ("values", "update_critic")
"""Stages only a run with a critic has: a run without one neither times nor logs them."""
NOT_RUN = {
    "policy_loss": 0.0, "clip_frac": 0.0, "clip_frac/low": 0.0, "clip_frac/high": 0.0,
    "approx_kl": 0.0, "ratio/mean": 1.0, "entropy": 0.0, "grad_norm": 0.0, "kl": 0.0,
    "advantage/mean": 0.0,
}
"""Values of the per-step metrics whose stage did not run this step (critic warmup, no
reference): every RL metric is in every line of metrics.jsonl, never NaN. A run without a
critic logs no critic metric at all (value_loss, critic/*, timing/values, ...)."""


def step_stages(with_critic: bool) -> tuple[str, ...]:
    """The stages a step times: all of STAGES, less CRITIC_STAGES without a critic."""
    return STAGES if with_critic else tuple(s for s in STAGES if s not in CRITIC_STAGES)


def step_seed(seed: int, step: int, salt: int) -> int:
    """A seed for one use in one step (generation round `salt`, shuffling, …): the same on
    a resumed run as on an uninterrupted one."""
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**62)


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
    """Rewards, accuracy (when a function declares correctness), lengths and truncation over
    every generated row of the step; the
    reward functions' error and NaN counts are summed over the rounds, out of `reward/samples`."""
    b = RLBatch.concat(batches)
    merged = merge_metrics([(len(x), m) for x, m in zip(batches, reward_metrics)])
    for key in merged:
        if key.endswith(("/errors", "/nan")):
            merged[key] = sum(m.get(key, 0.0) for m in reward_metrics)
    total, lengths = b.rewards["total"], b.lengths.float()
    merged.update({
        "reward/samples": float(len(b)),
        "reward/mean": float(total.mean()),
        "reward/std": float(total.std()) if len(total) > 1 else 0.0,
        "score/mean": float(b.scores.mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "truncation_rate": float(b.truncated.float().mean()),
        "zero_std_group_frac": float((~filter_groups(b.scores, n)).float().mean()) if n > 1 else 0.0,
    })
    if "correct" in b.rewards:  # a function declares correctness (`Reward.accuracy_from`)
        merged["accuracy"] = float(b.rewards["correct"].mean())
    for name, values in b.rewards.items():
        if name not in ("total", "correct"):
            valid = values[~values.isnan()]
            merged[f"reward/{name}/mean"] = float(valid.mean()) if len(valid) else 0.0
    episodes = [(len(x), x.meta["episode_metrics"]) for x in batches if "episode_metrics" in x.meta]
    if episodes:  # multi-turn: over every round (`envs.merge_episode_metrics`); never NaN in metrics.jsonl
        merged.update(merge_episode_metrics(episodes))
        merged["env/reward/mean"] = 0.0 if math.isnan(merged["env/reward/mean"]) else merged["env/reward/mean"]
    return merged


def mask_truncated(batch: RLBatch) -> RLBatch:
    """Remove truncated responses from the loss (their scores still count in group baselines)."""
    return batch.replace(response_mask=batch.response_mask * (~batch.truncated).long()[:, None])


def correct_rollout(batch: RLBatch, corr: RolloutCorrectionConfig) -> tuple[RLBatch, dict[str, float]]:
    """The gap between the engine's log-probs and the actor's old ones (rollout_corr/*), and,
    with `corr.rollout_is` set, the correction's weights as the batch's `rollout_is_weights`
    (`algos.rollout_correction`), which the actor's loss multiplies its policy-gradient term by.
    With the correction off, the weights it would apply (token level, the configured mode and
    thresholds) are still described by the rollout_is_* metrics, so a user sees the gap and what
    the correction would do before turning it on; the batch is left as it was."""
    batch.require("old_logp", "rollout_logp", "response_mask", role="rollout correction",
                  why="it compares the engine's log-probs (rollout.calculate_log_probs) with the actor's")
    weights, metrics = rollout_correction(
        batch.old_logp, batch.rollout_logp, batch.response_mask, level=corr.rollout_is or "token",
        mode=corr.rollout_is_mode, c_low=corr.rollout_is_threshold_lower, c_high=corr.rollout_is_threshold)
    metrics = {k: float(v) for k, v in metrics.items()}
    if corr.rollout_is is None:
        return batch, metrics
    return batch.replace(rollout_is_weights=weights), metrics


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
