"""Preference pairs for the reward-model and DPO trainers: loading, tokenisation, truncation,
and the collator that puts chosen and rejected into one batch.

Rows are TRL's preference formats (see `posttrain.data.formats`):
  - explicit prompt: `prompt`, `chosen`, `rejected` (strings, or chat messages with the
    responses as assistant turns);
  - implicit prompt: `chosen`, `rejected` only; the prompt is their longest shared prefix
    (`split_implicit_prompt`, TRL's `extract_prompt`).
A reward-model row may carry a numeric `margin` (Llama 2); extra columns are kept on the rows.

Each side is encoded as a prompt/completion row by `posttrain.data.collate`: `tokenizer(prompt)`
then `tokenizer(response, add_special_tokens=False)` and EOS, or the chat template of the prompt
(with the generation prompt) followed by the rest of the conversation's template. This is the
exact layout `posttrain.rewards.reward_model.encode_for_reward` scores at PPO time, so a reward
model is trained on what it will see. The prompt is tokenized once per pair; both sides must
render it identically (else an error names the row).

Lengths (counted in `PairStats`, reported as `data/*` metrics with the first step):
  1. `max_prompt_length`: a longer prompt keeps its *last* tokens (TRL's `keep_end`), `n_prompt_truncated`.
     Before tokenising, the prompt keeps its last `char_bound` characters and each response
     its first (`collate.cut_text`): a 30 MB field costs milliseconds, with the same pair.
  2. `max_length`: prompt + response longer than it is cut at the end (`truncate`, counted in
     `n_truncated` once per pair) or the pair is dropped (`drop`, `n_dropped_too_long`).
  3. A side left with no response token (the prompt fills max_length) drops the pair
     (`n_dropped_no_loss`): it would compare two identical sequences.

A pair example is `{"prompt_ids", "chosen_ids", "rejected_ids"}` (token lists; the response
ids exclude the prompt) plus `margin` (float) when the data has one and `ref_logps`
([chosen, rejected]) once the DPO trainer has precomputed them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch

from posttrain.data.batch import IGNORE_INDEX, PairBatch
from posttrain.data.collate import (
    TokenizeStats,
    char_bound,
    cut_text,
    pad_collate,
    tokenize_example,
)
from posttrain.data.formats import DataFormatError, split_implicit_prompt
from posttrain.data.sources import load_and_validate

logger = logging.getLogger(__name__)

PREFERENCE_FORMATS = ("preference", "implicit_preference")


@dataclass
class PairStats(TokenizeStats):
    """What tokenisation did to a preference dataset (rows are pairs)."""

    n_prompt_truncated: int = 0
    """Pairs whose prompt kept only its last `max_prompt_length` tokens."""

    def as_dict(self) -> dict[str, int]:
        return {**super().as_dict(), "n_prompt_truncated": self.n_prompt_truncated}


def load_pairs(source: Any) -> tuple[Any, str]:
    """Load and validate preference rows; returns the rows and `preference` or `implicit_preference`.

    Any other detected format is an error saying which columns were found.
    """
    rows, fmt = load_and_validate(source)
    if fmt not in PREFERENCE_FORMATS:
        raise DataFormatError(
            f"{rows.name}: preference training needs prompt/chosen/rejected (or chosen/rejected) "
            f"columns; found {', '.join(map(str, rows[0]))} (format {fmt!r})"
        )
    return rows, fmt


def split_row(row: Mapping[str, Any], fmt: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row; an implicit prompt is the shared prefix."""
    if fmt == "implicit_preference":
        return split_implicit_prompt(row["chosen"], row["rejected"])
    return row["prompt"], row["chosen"], row["rejected"]


def check_margins(rows: Sequence[Mapping[str, Any]]) -> bool:
    """True when the rows carry a `margin` column; then every row must hold a finite number."""
    if "margin" not in rows[0]:
        return False
    locate = getattr(rows, "locate", lambda i: f"row {i + 1}")
    for i, row in enumerate(rows):
        value = row.get("margin")
        if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
            raise DataFormatError(
                f"{locate(i)}: column 'margin' must be a finite number in every row (row 1 has "
                f"one), found {value!r}"
            )
    return True


def _encode_side(tokenizer: Any, prompt: Any, response: Any, bound: int | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one side, as the SFT prompt/completion encoder makes them;
    the response is first cut to its first `bound` characters (`collate.char_bound` of
    max_length: it is cut at the end to at most max_length tokens anyway)."""
    response = cut_text(response, bound)
    ex = tokenize_example(
        {"prompt": prompt, "completion": response}, tokenizer, "prompt_completion", completion_only_loss=True
    )
    ids, labels = ex["input_ids"], ex["labels"]
    n_prompt = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    return ids[:n_prompt], ids[n_prompt:]


def encode_pair(
    row: Mapping[str, Any],
    tokenizer: Any,
    fmt: str,
    max_length: int,
    max_prompt_length: int | None = None,
    truncation: str = "truncate",
    bound: int | None = None,
    prompt_bound: int | None = None,
) -> tuple[dict[str, Any] | None, str, bool]:
    """One pair example (see the module doc), the length outcome and whether the prompt was cut.

    outcome: kept | truncated | too_long | no_loss; the example is None when it is dropped.
    `bound`: `collate.char_bound(tokenizer, max_length)`, so that a huge response is not
    tokenised whole; `prompt_bound`: `char_bound` of max_prompt_length (else max_length), the
    prompt's last characters kept, as its last tokens are (`collate.cut_text`). The same
    example either way.
    """
    prompt, chosen, rejected = split_row(row, fmt)
    prompt = cut_text(prompt, prompt_bound, keep_end=True)
    prompt_ids, chosen_ids = _encode_side(tokenizer, prompt, chosen, bound)
    prompt_again, rejected_ids = _encode_side(tokenizer, prompt, rejected, bound)
    if prompt_again != prompt_ids:
        raise DataFormatError("the prompt tokenizes differently before chosen and before rejected")
    prompt_cut = max_prompt_length is not None and len(prompt_ids) > max_prompt_length
    if prompt_cut:
        prompt_ids = prompt_ids[-max_prompt_length:]
    room = max_length - len(prompt_ids)
    too_long = len(chosen_ids) > room or len(rejected_ids) > room
    if too_long and truncation == "drop":
        return None, "too_long", prompt_cut
    chosen_ids, rejected_ids = chosen_ids[: max(room, 0)], rejected_ids[: max(room, 0)]
    if not chosen_ids or not rejected_ids:
        return None, "no_loss", prompt_cut
    example = {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    if "margin" in row:
        example["margin"] = float(row["margin"])
    return example, "truncated" if too_long else "kept", prompt_cut


def tokenize_pairs(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    fmt: str,
    max_length: int,
    max_prompt_length: int | None = None,
    truncation: str = "truncate",
) -> tuple[list[dict[str, Any]], PairStats]:
    """Encode every pair (see `encode_pair`); errors name the row. Cuts and drops are counted
    and logged as one warning; a dataset left with no pair is an error."""
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"truncation must be truncate or drop, got {truncation!r}")
    name = getattr(rows, "name", "dataset")
    locate = getattr(rows, "locate", None) or (lambda i: f"{name}: row {i + 1}")
    check_margins(rows)
    stats, examples, bound = PairStats(), [], char_bound(tokenizer, max_length)
    # A prompt over max_prompt_length keeps its last tokens; without one, a prompt over
    # max_length leaves no room and drops the pair: the bound of either keeps the outcome.
    prompt_bound = char_bound(tokenizer, max_prompt_length if max_prompt_length is not None else max_length)
    for i, row in enumerate(rows):
        try:
            example, outcome, prompt_cut = encode_pair(
                row, tokenizer, fmt, max_length, max_prompt_length, truncation, bound, prompt_bound
            )
        except Exception as e:
            raise DataFormatError(f"{locate(i)}: cannot tokenize the pair: {e}") from e
        stats._record(outcome, locate(i))
        stats.n_prompt_truncated += prompt_cut
        if example is not None:
            examples.append(example)
    if stats.n_truncated or stats.n_dropped or stats.n_prompt_truncated:
        logger.warning(
            "%s: of %d pairs, %d had the prompt cut to max_prompt_length=%s, %d were cut to "
            "max_length=%d, %d dropped as too long, %d dropped with no response token left%s",
            name, stats.n_rows, stats.n_prompt_truncated, max_prompt_length, stats.n_truncated,
            max_length, stats.n_dropped_too_long, stats.n_dropped_no_loss,
            f" (first: {', '.join(stats.dropped_at)})" if stats.dropped_at else "",
        )
    if not examples:
        raise DataFormatError(f"{name}: every one of {stats.n_rows} pairs was dropped ({stats.as_dict()})")
    return examples, stats


def prepare_pairs(source: Any, tokenizer: Any, data: Any) -> tuple[Any, list[dict[str, Any]], PairStats]:
    """Load, validate and tokenize a preference dataset as the config section `data` says
    (`max_length`, `max_prompt_length`, `truncation`): (rows, examples, stats)."""
    rows, fmt = load_pairs(source)
    examples, stats = tokenize_pairs(rows, tokenizer, fmt, data.max_length, data.max_prompt_length, data.truncation)
    return rows, examples, stats


def pair_collate(examples: Sequence[Mapping[str, Any]], pad_token_id: int) -> PairBatch:
    """B pairs → one `PairBatch`, both sides right-padded to one width T as `pad_collate`
    pads, labels -100 on the prompt and padding (only response tokens are scored);
    `margin` (B,) when the examples have one; `ref_chosen_logps`, `ref_rejected_logps` (B,)
    when they carry precomputed reference log-probs.
    """
    sides = [
        {"input_ids": ex["prompt_ids"] + ex[key], "labels": [IGNORE_INDEX] * len(ex["prompt_ids"]) + ex[key]}
        for key in ("chosen_ids", "rejected_ids")
        for ex in examples
    ]
    chosen, rejected = pad_collate(sides, pad_token_id).split(len(examples))
    margin = ref = None
    if "margin" in examples[0]:
        margin = torch.tensor([ex["margin"] for ex in examples], dtype=torch.float32)
    if "ref_logps" in examples[0]:
        ref = torch.tensor([ex["ref_logps"] for ex in examples], dtype=torch.float32)  # (B, 2)
    return PairBatch(
        chosen_ids=chosen.input_ids, chosen_mask=chosen.attention_mask, chosen_labels=chosen.labels,
        rejected_ids=rejected.input_ids, rejected_mask=rejected.attention_mask, rejected_labels=rejected.labels,
        margin=margin,
        ref_chosen_logps=None if ref is None else ref[:, 0],
        ref_rejected_logps=None if ref is None else ref[:, 1],
    )
