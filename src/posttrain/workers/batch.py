"""Typed batch containers that travel between the RL roles (veRL's DataProto, but typed).

Notation: B rows (one response each; B = prompts × n after `repeat(n)`), Tp prompt width,
Tr response width. A row is `[pad … pad, prompt | response, pad … pad]`: prompts are
left-padded and responses right-padded, so `cat(prompt_ids, response_ids)` is a causal
LM input whose response starts at column Tp for every row.

The generic row operations (`select`, `concat`, `split`, `chunk`, `chunk_by_tokens`,
`repeat`, `pad_to_multiple`, `to`, `replace`, `require`) come from `BatchOps`
(`posttrain.data.batch`, re-exported here), driven by each field's kind: prompt fields are
"left" (padding added on the left), response fields "right". What padding holds is never
read by a role or an algorithm (masks decide), so ops pad with 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.data.batch import BatchOps
from posttrain.data.prompts import collate_prompts

__all__ = ["BatchOps", "RLBatch"]


@dataclass
class RLBatch(BatchOps):
    """One RL step's data as it moves driver → roles → driver (fields fill in stage by stage).

    Rows of a group (the n responses to one prompt) are contiguous: rows [kn, (k+1)n)
    answer prompt k. Log-probs are of the temperature-scaled policy, log softmax(z/T)[y].
    Construction checks that every filled field (and each column) has the same B; a role
    states the fields it reads with `require` at its entry.
    """

    prompt_ids: torch.Tensor | None = field(default=None, metadata={"kind": "left"})
    """(B, Tp) long: prompt tokens, left-padded (BOS / chat template included)."""
    prompt_mask: torch.Tensor | None = field(default=None, metadata={"kind": "left"})
    """(B, Tp) long: 1 on prompt tokens, 0 on left padding."""
    response_ids: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) long: generated tokens, right-padded; a stop token (EOS) is kept as the last one."""
    response_mask: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) long: 1 on tokens that are trained on, 0 on padding (and on rows that
    `algorithm.mask_truncated_completions` removes from the loss)."""
    rollout_logp: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: log-probs the rollout engine reported while sampling."""
    old_logp: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: log-probs of the behaviour policy π_old (the ratio's denominator)."""
    rollout_is_weights: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: the rollout correction's importance weights on the policy-gradient term
    (`algos.rollout_correction`, veRL's name), 0 on padding; None = no correction."""
    versions: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) long: the policy version that generated each token (the number of actor updates
    behind the weights it was sampled with; trainer.async_training)."""
    ref_logp: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: log-probs under the frozen reference π_ref (only when KL is used)."""
    values: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: critic values V(s_t), s_t = prompt + response[:t] (PPO only)."""
    token_rewards: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: per-token reward r_t: the sequence score on the last valid token,
    minus β·KL_t when the KL penalty is in the reward."""
    advantages: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: advantage of every token (sequence-level estimators broadcast theirs)."""
    returns: torch.Tensor | None = field(default=None, metadata={"kind": "right"})
    """(B, Tr) float: value targets (GAE) for the critic."""
    scores: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) float: the sequence reward (weighted reward functions and/or reward model,
    plus overlong and missing-EOS shaping)."""
    uid: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) long: id of the prompt a row answers, unique within a run (rows of a group share it)."""
    prompt_index: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) long: the prompt's index in the training prompts (the sample log's prompt id)."""
    truncated: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) bool: generation hit max_new_tokens without a stop token; for an episode, a turn or
    token limit (`rollout.multi_turn`) ended it before the environment said done."""
    lengths: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) long: generated (model) tokens per row (before any loss masking)."""
    total_lengths: torch.Tensor | None = field(default=None, metadata={"kind": "row"})
    """(B,) long: trajectory tokens per row of a multi-turn episode, model and environment
    tokens (`rollout.episodes`); None for single-turn responses, where it equals `lengths`."""
    prompts: list[Any] | None = field(default=None, metadata={"kind": "list"})
    """B prompts as the dataset gave them (a string or a list of chat messages)."""
    completions: list[Any] | None = field(default=None, metadata={"kind": "list"})
    """B decoded responses (a string; a one-message list for chat prompts, as TRL)."""
    episodes: list[dict[str, Any]] | None = field(default=None, metadata={"kind": "list"})
    """B records of multi-turn episodes (`workers.rollout_worker.episode_record`): what
    `reset` returned, each turn's bounds, text, tool calls and step reward; None single-turn."""
    columns: dict[str, Any] | None = field(default=None, metadata={"kind": "columns"})
    """Dataset columns besides the prompt (answer, tests, task, …): name -> B values."""
    rewards: dict[str, torch.Tensor] | None = field(default=None, metadata={"kind": "columns"})
    """Per-sample reward terms, name -> (B,) float: each reward function's raw value (NaN
    where it gave None), `total` (their weighted sum, before shaping), `correct` (0/1)."""
    meta: dict[str, Any] = field(default_factory=dict, metadata={"kind": "meta"})
    """Facts about the whole batch (e.g. {"n": 8})."""

    @classmethod
    def from_prompts(cls, examples: Sequence[dict], pad_id: int) -> RLBatch:
        """A batch holding only prompts, from `data.prompts.load_prompts` examples."""
        return cls(**collate_prompts(examples, pad_id))

    # -------------------------------------------------------------- derived views

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, Tp + Tr) long: prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def trajectory_lengths(self) -> torch.Tensor:
        """(B,) long: response tokens the model conditions on, `total_lengths` for episodes
        (model + environment tokens), else `lengths`. The last of them is a model token."""
        return self.total_lengths if self.total_lengths is not None else self.lengths

    @property
    def generated_mask(self) -> torch.Tensor:
        """(B, Tr) long: 1 on every response token, the environment's included (episodes),
        from `trajectory_lengths` (unlike `response_mask`, not cleared for environment tokens
        nor for rows taken out of the loss)."""
        width = self.response_ids.shape[1]
        lengths = self.trajectory_lengths.to(self.response_ids.device)
        return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, Tp + Tr) long: 1 on prompt and response tokens, environment tokens included
        (what the model sees does not depend on which tokens or rows the loss uses)."""
        return torch.cat([self.prompt_mask, self.generated_mask.to(self.prompt_mask.dtype)], dim=1)

    def trimmed(self) -> RLBatch:
        """The same rows without all-padding columns (left of the prompts, right of the
        responses), so a forward pass does no work for padding the whole batch shares."""
        prompt_start = int((self.prompt_mask.sum(0) > 0).nonzero()[0, 0]) if len(self) else 0
        width = int(self.trajectory_lengths.max()) if len(self) else 0
        out = {}
        for name, kind, value in self._fields():
            if value is not None and kind == "left":
                value = value[:, prompt_start:]
            elif value is not None and kind == "right":
                value = value[:, :width]
            out[name] = value
        return RLBatch(**out)

    def token_counts(self) -> torch.Tensor:
        """(B,) prompt plus response tokens of each row (what a forward pass costs; an
        episode's environment tokens included)."""
        return self.prompt_mask.sum(1).cpu() + self.trajectory_lengths.cpu()
