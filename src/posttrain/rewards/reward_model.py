"""A trained reward model as a reward function.

    rm = reward_model("runs/rm/final", batch_size=16)
    rm(prompts, completions, completion_ids)       # [0.83, -1.2, ...]: one score per completion

The model (a `ScalarHeadModel`: our saved reward models, or any HF `*ForSequenceClassification`
checkpoint with one label whose weights hold its score head) and its tokenizer are loaded from `path` on the first call and kept. The first call therefore
includes the load: either give the reward runner a `timeout_s` that covers it, or call
`rm.load()` before training.

What the reward model reads, for each (prompt, completion):
  - conversational prompt (a list of messages): the tokenizer's chat template (or `template`)
    of prompt + completion, the completion being the assistant turn (a string is wrapped as
    `{"role": "assistant", "content": completion}`; a list of messages is used as it is);
  - string prompt: `tokenizer(prompt)` (with the tokenizer's BOS, if it adds one), then
    `tokenizer(completion, add_special_tokens=False)`, then EOS if missing.
This is exactly how `posttrain.data.collate` encodes prompt/completion rows for training
(with `completion_only_loss=False`), so a reward model trained on our data is scored on the
token layout it was trained on, and the score is read at the EOS that ends the response.

The text is re-tokenized with the reward model's tokenizer, as TRL does for reward models;
the policy's `completion_ids` are not used: they are ids of the policy's vocabulary, which
is often not the reward model's. (A completion cut at `max_new_tokens` still gets its EOS
here: the reward model judges the text, and an overlong penalty is a separate reward.)

Sequences longer than `max_length` keep their first `max_length` tokens (the training
collator's "truncate"), and are counted in the metric `reward/<name>/truncated`.

A folder without a trained score head (a causal LM, such as an SFT run's final/) is refused
when the scorer is made: its head would be random, and so would every reward.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["RewardModelScorer", "encode_for_reward", "reward_model"]


def encode_for_reward(tokenizer: Any, prompt: str | list, completion: str | list) -> list[int]:
    """Token ids of prompt + completion as the reward model reads them (see the module doc)."""
    if isinstance(prompt, list):
        turn = completion if isinstance(completion, list) else [_assistant(completion)]
        out = tokenizer.apply_chat_template(prompt + turn, tokenize=True, return_dict=True)
        return list(out["input_ids"])
    if not isinstance(completion, str):
        raise TypeError(
            f"a string prompt needs a string completion, got {type(completion).__name__}; "
            "conversational completions need conversational prompts (lists of messages)"
        )
    ids = list(tokenizer(prompt)["input_ids"])
    ids += tokenizer(completion, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


def _assistant(content: Any) -> Mapping[str, Any]:
    return {"role": "assistant", "content": content}


class RewardModelScorer:
    """A reward function (TRL signature) scoring each completion with a reward model.

    Args:
        path: local directory of the reward model and its tokenizer.
        batch_size: sequences per forward pass (sorted by length first, to pad less).
        device: "auto" (CUDA when available, else CPU) or a torch device.
        dtype: "auto" (bfloat16 on a CUDA device that supports it, else float32),
            "float32", "bfloat16" or "float16".
        max_length: longest sequence scored; longer ones keep their first max_length tokens.
        template: a Jinja chat template used instead of the tokenizer's, for
            conversational prompts.
    """

    def __init__(
        self,
        path: str | Path,
        batch_size: int = 32,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        max_length: int | None = None,
        template: str | None = None,
    ):
        from posttrain.models.heads import MissingScoreHead, require_score_head

        if batch_size < 1:
            raise ValueError(f"reward_model: batch_size must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"reward_model: max_length must be >= 1, got {max_length}")
        try:  # fail now, naming the path, if it is not a model dir or has no trained head
            require_score_head(path)
        except MissingScoreHead as err:
            raise ValueError(
                f"reward_model: {err}. Train one with `posttrain rm` or point reward.model_path "
                "at an RM's final/"
            ) from None
        self.__name__ = "reward_model"
        self.path, self.batch_size, self.max_length = str(path), batch_size, max_length
        self.device, self.dtype, self.template = device, dtype, template
        self.model: Any = None
        self.tokenizer: Any = None
        self._lock = threading.Lock()  # the runner may call from several threads at once
        self._truncated = 0

    def load(self) -> RewardModelScorer:
        """Load the model and tokenizer now (the first call does it otherwise)."""
        with self._lock:
            if self.model is None:
                self.tokenizer = self._load_tokenizer()
                self.model = self._load_model()
        return self

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"reward_model: cannot load a tokenizer from {self.path}: {err}"
            ) from None
        if self.template is not None:
            tokenizer.chat_template = self.template
        return tokenizer

    def _load_model(self) -> Any:
        from posttrain.models.heads import ScalarHeadModel
        from posttrain.models.loading import disable_dropout, resolve_device, resolve_dtype

        device = resolve_device(self.device)
        model = ScalarHeadModel.from_pretrained(
            self.path, device=device, dtype=resolve_dtype(self.dtype, device), head="stored"
        )
        disable_dropout(model, "reward model")  # eval() already skips it; p = 0 holds in train() too
        return model.eval().requires_grad_(False)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        **columns: Any,
    ) -> list[float]:
        """One score per completion, in order."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        self.load()
        rows = [encode_for_reward(self.tokenizer, p, c) for p, c in zip(prompts, completions)]
        if self.max_length is not None:
            long = sum(len(ids) > self.max_length for ids in rows)
            rows = [ids[: self.max_length] for ids in rows]
            with self._lock:
                self._truncated += long
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        scores: list[float] = [0.0] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ids, mask = self._pad([rows[i] for i in chunk])
            with torch.inference_mode():
                out = self.model.scores(ids, mask).tolist()
            for i, score in zip(chunk, out):
                scores[i] = score
        return scores

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad to the longest row: input_ids and attention_mask (B, T) on the model's device."""
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        pad = 0 if pad is None else pad  # any id: padded positions are masked out
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[b, : len(row)] = 1
        return ids.to(self.model.device), mask.to(self.model.device)

    def pop_metrics(self) -> dict[str, float]:
        """Sequences cut to max_length since the last call (logged as reward/<name>/truncated)."""
        with self._lock:
            truncated, self._truncated = self._truncated, 0
        return {"truncated": float(truncated)}


def reward_model(
    path: str | Path,
    batch_size: int = 32,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    max_length: int | None = None,
    template: str | None = None,
) -> RewardModelScorer:
    """A reward function scoring completions with the reward model saved in `path`.

    Arguments as in `RewardModelScorer`; the model loads on the first call (or `.load()`).
    """
    return RewardModelScorer(path, batch_size, device, dtype, max_length, template)
