"""The reward role: score responses and turn scores into per-token rewards.

Notation: B rows, Tr response tokens. For each row:

    score = Σ_f w_f · r_f                              (reward functions, `RewardRunner`; a
                                                       trained reward model is one of them,
                                                       `posttrain.rewards.reward_model`)
            + overlong_penalty(length)                 (DAPO eq. 13, when algorithm.overlong.buffer > 0)
            − missing_eos_penalty · [truncated]        (TRL, when reward.missing_eos_penalty is set)
    token_rewards[t] = score if t is the last generated token else 0   (veRL, TRL PPO)

For a multi-turn episode the last token of the trajectory (`trajectory_lengths` − 1, always
a model token) takes the score, `completion_ids` are the whole trajectory's tokens (as
`completions` are its text), and overlong shaping counts model tokens (`lengths`).

and, later in the step once old and reference log-probs exist (`apply_kl`), the KL
penalty of the reward: token_rewards[t] −= β · KL_t (k1 by default). That second half is
a separate call because in the driver's order (veRL's) the reward is computed before the
log-prob passes; this is where veRL's `apply_kl_penalty` runs too.

`accuracy`: only a reward function that declares a correctness notion (`is_correctness = True`:
the built-ins math_accuracy, exact_match, task_reward and code_tests; a user's function may
declare it too) defines one. A sample is correct when the first such function
(`accuracy_from`) gives ≥ 1 (its raw value, before weights and shaping: 1 is right, and for
code_tests every test passed). Without one (a reward model, a judge, a format or length
reward) there is no `correct` term and no accuracy metric: a threshold on their scores would
mean nothing.

`check_step`: a reward function that failed on every sample of the first step, or of
`max_bad_steps` steps in a row, stops the run (`posttrain.rewards.checks.RewardFailureGuard`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from posttrain.algos import kl_penalty, masked_mean, overlong_penalty
from posttrain.rewards import RewardRunner
from posttrain.rewards.checks import RewardFailureGuard
from posttrain.workers.batch import RLBatch


def place_on_last_token(scores: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B,) scores → (B, width) float with score_i at column lengths_i − 1, 0 elsewhere."""
    out = torch.zeros(len(scores), width, dtype=torch.float32)
    rows = torch.arange(len(scores))[lengths > 0]
    out[rows, lengths[lengths > 0] - 1] = scores[rows].float()
    return out


def correctness_function(runner: RewardRunner) -> str | None:
    """The name of the first reward function that declares a correctness notion
    (`fn.is_correctness`), or None: the source of `accuracy`."""
    return next((name for name, fn in runner.functions if getattr(fn, "is_correctness", False)), None)


class Reward:
    """Scores a batch (veRL's reward manager + reward-model worker).

    Args:
        runner: the reward functions (a reward model included), with their weights.
        max_new_tokens, overlong_buffer, overlong_penalty: DAPO's soft punishment (buffer 0 = off).
        missing_eos_penalty: subtracted from truncated responses' scores (None = off).
        max_bad_steps: steps in a row on which a function may fail on every sample (`check_step`).
    """

    def __init__(
        self,
        runner: RewardRunner,
        max_new_tokens: int = 256,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        missing_eos_penalty: float | None = None,
        max_bad_steps: int = 5,
    ):
        self.runner = runner
        self.accuracy_from = correctness_function(runner)
        self.guard = RewardFailureGuard(runner, max_bad_steps)
        self.max_new_tokens = max_new_tokens
        self.overlong = (overlong_buffer, overlong_penalty)
        self.missing_eos_penalty = missing_eos_penalty

    def score(self, batch: RLBatch) -> tuple[RLBatch, dict[str, float]]:
        """Fill `scores`, `token_rewards` and `rewards`; return the runner's metrics. Needs
        `response_ids`, `lengths`, `prompts`, `completions` (and `truncated` with the
        missing-EOS penalty); `columns` when the reward functions read any."""
        batch.require("response_ids", "lengths", "prompts", "completions", role="reward.score")
        if self.missing_eos_penalty:
            batch.require("truncated", role="reward.score", why="reward.missing_eos_penalty is set")
        terms, metrics = self._reward_terms(batch)
        total = terms["total"].clone()
        buffer, alpha = self.overlong
        if buffer:
            total += overlong_penalty(batch.lengths, self.max_new_tokens, buffer, alpha)
        if self.missing_eos_penalty:
            total -= self.missing_eos_penalty * batch.truncated.float()
        width = batch.response_ids.shape[1]
        return batch.replace(
            scores=total,
            token_rewards=place_on_last_token(total, batch.trajectory_lengths, width),
            rewards=terms,
        ), metrics

    def _reward_terms(self, batch: RLBatch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Each function's values (NaN for None), their weighted `total`, and `correct` (0/1)
        when a function declares correctness (`accuracy_from`)."""
        ids = [row[: int(n)].tolist() for row, n in zip(batch.response_ids, batch.trajectory_lengths)]
        result = self.runner.score(batch.prompts, batch.completions, ids, batch.columns or {})
        terms = {
            name: torch.tensor([math.nan if v is None else float(v) for v in values])
            for name, values in result.per_function.items()
        }
        terms["total"] = result.total.float().cpu()
        if self.accuracy_from is not None:
            terms["correct"] = (torch.nan_to_num(terms[self.accuracy_from], nan=0.0) >= 1.0).float()
        return terms, dict(result.metrics)

    def check_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Raise `RewardFunctionError` when a function failed on every sample of step `step`
        (its first step checked, or `max_bad_steps` in a row); `metrics` are the step's
        `reward/<fn>/errors` and `reward/samples`, summed over its generation rounds."""
        errors = {name: metrics.get(f"reward/{name}/errors", 0.0) for name in self.runner.names}
        self.guard.update(step, errors, int(metrics["reward/samples"]))

    @staticmethod
    def apply_kl(batch: RLBatch, coef: float, kind: str) -> tuple[RLBatch, float]:
        """token_rewards −= coef · kl_penalty(old_logp, ref_logp, kind) on valid tokens.

        Returns the batch and the mean KL over valid tokens."""
        batch.require("response_mask", "old_logp", "ref_logp", "token_rewards", role="reward.apply_kl")
        mask = batch.response_mask.bool()
        kl = torch.where(mask, kl_penalty(batch.old_logp, batch.ref_logp, kind), 0.0)
        return batch.replace(token_rewards=batch.token_rewards - coef * kl), float(masked_mean(kl, mask))
