"""SFT tokenisation with loss masks, the padding collator, and the token-summed LM loss.

Conventions (every trainer relies on these):

- An example is `{"input_ids": list[int], "labels": list[int]}` of equal length. `labels`
  is *aligned* with `input_ids`: `labels[t]` is `input_ids[t]` where token t is trained and
  -100 (`IGNORE_INDEX`) where it is not. The shift by one happens in the loss, never here:
  the logits at position t predict `labels[t + 1]` (see `causal_lm_loss_sum`), so
  `labels[0]` is never used.
- What is trained, as in TRL's `SFTTrainer`:
  - `text`: every token, plus an appended EOS.
  - `prompt_completion` (strings): `tokenizer(prompt)` (with the tokenizer's BOS, if it
    adds one) followed by `tokenizer(completion, add_special_tokens=False)` and EOS. The
    two halves are tokenized apart and joined, never re-tokenized as one string, so the
    prompt/completion boundary is a token boundary and the prompt ids are exactly what
    generation would see; the completion's first token is the one the model would
    generate after the prompt. With `completion_only_loss` (default True) only the
    completion and EOS are trained. With `environment_markers=(start, end)` every
    `start…end` span of the completion (markers included; the text tool protocol's
    `<result>…</result>`) is environment text: tokenized on its own, as a multi-turn
    episode appends it, and never trained on (`posttrain.envs`).
  - `prompt_completion` (messages): the chat template of the prompt with
    `add_generation_prompt=True`, then the rest of the template of prompt + completion;
    the completion tokens (content and the template's end-of-turn) are trained. The
    template's rendering of the prompt must be a token prefix of the full conversation,
    else an error (the boundary would be a guess).
  - `messages`: the chat template; every token is trained, or with `assistant_only_loss`
    only the tokens inside the template's `{% generation %}` marks (assistant content and
    end-of-turn). Conversational data gets no extra EOS: the template ends turns.
- Longer than `max_length`: cut to the first `max_length` tokens (`truncation="truncate"`,
  counted in `TokenizeStats.n_truncated`) or dropped (`"drop"`, counted). Each text field
  is cut to `char_bound` characters before it is tokenised (`cut_text`, which also cuts the
  DPO and RL prompts from the left), which changes no result (the row is as long in tokens
  either way) but makes a 30 MB row cost milliseconds. An example left
  with no trained token (e.g. a prompt that fills `max_length`) is dropped and counted:
  it would add zero loss while looking like data. Drops and truncations are logged.
- `pad_collate` makes an `LMBatch` (`posttrain.data.batch`), padded on the right: `input_ids` with the pad id, `attention_mask` 0 and
  `labels` -100 on padding.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.data.batch import IGNORE_INDEX, LMBatch
from posttrain.data.formats import DataFormatError, detect_format, is_conversational, validate_rows
from posttrain.data.sources import first_source

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("truncate", "drop")
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MAX_EXAMPLES = 5  # row locations quoted in the drop warning


@dataclass
class TokenizeStats:
    """What tokenisation did to a dataset, for logs and run reports."""

    n_rows: int = 0
    """Rows seen."""
    n_truncated: int = 0
    """Rows kept after cutting them to `max_length`."""
    n_dropped_too_long: int = 0
    """Rows longer than `max_length` dropped because `truncation="drop"`."""
    n_dropped_no_loss: int = 0
    """Rows dropped because no trained token was left (after truncation, or none to start)."""
    dropped_at: list[str] = field(default_factory=list)
    """Locations of the first few dropped rows (`path:line`), to find them in the data."""

    @property
    def n_dropped(self) -> int:
        return self.n_dropped_too_long + self.n_dropped_no_loss

    @property
    def n_kept(self) -> int:
        return self.n_rows - self.n_dropped

    def as_dict(self) -> dict[str, int]:
        """Counts as flat metrics, e.g. for `metrics.jsonl` or the run report."""
        return {
            "n_rows": self.n_rows,
            "n_kept": self.n_kept,
            "n_truncated": self.n_truncated,
            "n_dropped": self.n_dropped,
            "n_dropped_too_long": self.n_dropped_too_long,
            "n_dropped_no_loss": self.n_dropped_no_loss,
        }

    def _record(self, outcome: str, where: str | None) -> None:
        self.n_rows += 1
        self.n_truncated += outcome == "truncated"
        self.n_dropped_too_long += outcome == "too_long"
        self.n_dropped_no_loss += outcome == "no_loss"
        dropped = outcome in ("too_long", "no_loss")
        if dropped and where is not None and len(self.dropped_at) < _MAX_EXAMPLES:
            self.dropped_at.append(where)


@dataclass(frozen=True)
class _Options:
    fmt: str
    conversational: bool
    completion_only_loss: bool
    assistant_only_loss: bool
    add_eos: bool
    environment_markers: tuple[str, ...] = ()


def _check_options(
    tokenizer: Any,
    fmt: str,
    conversational: bool,
    completion_only_loss: bool | None,
    assistant_only_loss: bool,
    truncation: str,
    add_eos: bool,
    environment_markers: Sequence[str] = (),
) -> _Options:
    """Validate the settings against the data and tokenizer once, before any row is encoded."""
    if len(environment_markers) not in (0, 2) or not all(environment_markers):
        raise ValueError(f"environment_markers must be () or (start, end), got {list(environment_markers)!r}")
    if fmt not in _ENCODERS:
        raise DataFormatError(
            f"SFT tokenisation takes formats {', '.join(_ENCODERS)}; got {fmt!r} "
            "(preference data goes to the DPO or reward trainer, prompt-only data to RL)"
        )
    if truncation not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation must be one of {', '.join(TRUNCATION_MODES)}; got {truncation!r}"
        )
    if completion_only_loss and fmt != "prompt_completion":
        raise ValueError(
            f"completion_only_loss applies to prompt/completion data, not {fmt!r}"
            + ("; for messages use assistant_only_loss" if fmt == "messages" else "")
        )
    if conversational:
        try:
            template = tokenizer.get_chat_template()
        except ValueError:
            raise ValueError(
                "the tokenizer has no chat template; conversational data needs one "
                "(set tokenizer.chat_template)"
            ) from None
        if assistant_only_loss and not _GENERATION_MARK.search(template):
            raise ValueError(
                "the chat template has no {% generation %} marks; assistant_only_loss needs them "
                "— use a template that has them or set assistant_only_loss=false"
            )
        if assistant_only_loss and not getattr(tokenizer, "is_fast", False):
            raise ValueError("assistant_only_loss needs a fast tokenizer (token offsets)")
    elif assistant_only_loss:
        raise ValueError(
            "assistant_only_loss needs conversational data (messages, or prompt/completion as "
            "message lists); for string prompt/completion use completion_only_loss"
        )
    if add_eos and not conversational and tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set one or use add_eos=False")
    return _Options(
        fmt=fmt,
        conversational=conversational,
        completion_only_loss=fmt == "prompt_completion" and completion_only_loss is not False,
        assistant_only_loss=assistant_only_loss,
        add_eos=add_eos and not conversational,
        environment_markers=tuple(environment_markers),
    )


def _eos(tokenizer: Any, ids: list[int], opts: _Options) -> list[int]:
    if opts.add_eos and (not ids or ids[-1] != tokenizer.eos_token_id):
        return [tokenizer.eos_token_id]
    return []


def _encode_text(row: Mapping, tokenizer: Any, opts: _Options) -> tuple[list[int], list[int]]:
    ids = list(tokenizer(row["text"])["input_ids"])
    ids += _eos(tokenizer, ids, opts)
    return ids, [1] * len(ids)


def _encode_prompt_completion(
    row: Mapping, tokenizer: Any, opts: _Options
) -> tuple[list[int], list[int]]:
    if opts.conversational:
        prompt_ids = list(_chat(tokenizer, row["prompt"], add_generation_prompt=True)["input_ids"])
        full = _chat(
            tokenizer, row["prompt"] + row["completion"], assistant_mask=opts.assistant_only_loss
        )
        ids = list(full["input_ids"])
        if ids[: len(prompt_ids)] != prompt_ids:
            raise DataFormatError(
                "the chat template renders the prompt differently once the completion follows, "
                "so the prompt/completion boundary is unknown; use the messages format instead"
            )
        completion_ids = ids[len(prompt_ids) :]
        completion_mask = [1] * len(completion_ids)
    else:
        prompt_ids = list(tokenizer(row["prompt"])["input_ids"])
        completion_ids, completion_mask = [], []
        for piece, trained in split_environment_text(row["completion"], opts.environment_markers):
            piece_ids = list(tokenizer(piece, add_special_tokens=False)["input_ids"])
            completion_ids += piece_ids
            completion_mask += [int(trained)] * len(piece_ids)
        eos = _eos(tokenizer, completion_ids, opts)
        completion_ids, completion_mask = completion_ids + eos, completion_mask + [1] * len(eos)
        full = None
    ids = prompt_ids + completion_ids
    mask = [0 if opts.completion_only_loss else 1] * len(prompt_ids) + completion_mask
    if opts.assistant_only_loss:
        mask = [m & a for m, a in zip(mask, full["assistant_masks"])]
    return ids, mask


def split_environment_text(text: str, markers: Sequence[str]) -> list[tuple[str, bool]]:
    """`text` as (piece, trained) pieces: each `start…end` span (markers included) is
    environment text (trained False), the rest model text. An unclosed `start` is model text.

        split_environment_text("a<result>4</result>b", ("<result>", "</result>"))
        # [("a", True), ("<result>4</result>", False), ("b", True)]
    """
    if not markers:
        return [(text, True)]
    start, end = markers
    pieces, pos = [], 0
    while (i := text.find(start, pos)) >= 0 and (j := text.find(end, i + len(start))) >= 0:
        j += len(end)
        pieces += [(text[pos:i], True)] if i > pos else []
        pieces.append((text[i:j], False))
        pos = j
    return pieces + ([(text[pos:], True)] if pos < len(text) else [])


def _encode_messages(row: Mapping, tokenizer: Any, opts: _Options) -> tuple[list[int], list[int]]:
    full = _chat(tokenizer, row["messages"], assistant_mask=opts.assistant_only_loss)
    ids = list(full["input_ids"])
    mask = list(full["assistant_masks"]) if opts.assistant_only_loss else [1] * len(ids)
    return ids, mask


def _chat(
    tokenizer: Any,
    messages: list,
    add_generation_prompt: bool = False,
    assistant_mask: bool = False,
):
    return tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        add_generation_prompt=add_generation_prompt,
        return_assistant_tokens_mask=assistant_mask,
    )


_ENCODERS: dict[str, Callable[[Mapping, Any, _Options], tuple[list[int], list[int]]]] = {
    "text": _encode_text,
    "prompt_completion": _encode_prompt_completion,
    "messages": _encode_messages,
}


def _fit(ids: list[int], labels: list[int], max_length: int | None, truncation: str):
    """Apply the length policy: (ids, labels, outcome) with outcome in
    kept | truncated | too_long | no_loss; ids/labels are None when dropped."""
    outcome = "kept"
    if max_length is not None and len(ids) > max_length:
        if truncation == "drop":
            return None, None, "too_long"
        ids, labels, outcome = ids[:max_length], labels[:max_length], "truncated"
    # labels[0] is never predicted (nothing precedes it), so it does not count as loss.
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None, None, "no_loss"
    return ids, labels, outcome


def char_bound(tokenizer: Any, max_length: int | None) -> int | None:
    """How many characters of one text field can matter to the first `max_length` tokens:
    2 · (max_length + 1) · L, L the longest vocabulary entry in characters (None: no bound).

    A token covers at most L characters of text (a byte-level entry of k characters stands
    for k bytes, so at most k characters), so a field longer than the bound already makes
    more than max_length tokens: cutting it there keeps the row over max_length (truncated,
    or dropped, as before) and leaves its first max_length tokens as they were. The factor 2
    is slack for normalizers that drop characters and for the token that spans the cut."""
    if max_length is None:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * (max_length + 1) * max(longest, 1)


def cut_text(value: Any, bound: int | None, keep_end: bool = False) -> Any:
    """`value` (a string, chat messages, or a list of them) with each string and message
    `content` cut to its first `bound` characters, or with `keep_end` its last ones (a prompt
    cut from the left, as its tokens are); `value` itself when nothing is longer (None: no cut).

    With `bound = char_bound(tokenizer, n)` a longer text makes more than n tokens either way,
    so that a pathological row (one 30 MB line) is not tokenised whole only to be truncated:
    it costs milliseconds, not minutes and gigabytes. Its first n tokens (`keep_end`: its last
    n) are those of the whole text when the tokenizer's pieces are local: a cut more than n
    tokens away does not change them. Not so for a run of characters the tokenizer drops (a
    word-level tokenizer's whitespace) or, kept from the end, for one BPE word longer than
    the bound (merges run from its start): the tokens are then the cut text's."""
    if bound is None:
        return value
    if isinstance(value, str):
        if len(value) <= bound:
            return value
        return value[-bound:] if keep_end else value[:bound]
    if isinstance(value, list):
        cut = [cut_text(v, bound, keep_end) for v in value]
        return value if all(c is v for c, v in zip(cut, value)) else cut
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        content = cut_text(value["content"], bound, keep_end)
        return value if content is value["content"] else {**value, "content": content}
    return value


def _encode(row: Mapping, tokenizer: Any, opts: _Options, max_length: int | None, truncation: str,
            bound: int | None = None):
    ids, mask = _ENCODERS[opts.fmt]({k: cut_text(v, bound) for k, v in row.items()}, tokenizer, opts)
    labels = [tok if m else IGNORE_INDEX for tok, m in zip(ids, mask)]
    return _fit(ids, labels, max_length, truncation)


def tokenize_example(
    row: Mapping[str, Any],
    tokenizer: Any,
    fmt: str,
    max_length: int | None = None,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    truncation: str = "truncate",
    add_eos: bool = True,
    stats: TokenizeStats | None = None,
    environment_markers: Sequence[str] = (),
) -> dict[str, list[int]] | None:
    """Tokenize one SFT row (`text`, `prompt_completion` or `messages`) into
    `{"input_ids", "labels"}` (see the module doc), or None when the length policy drops it.

    `completion_only_loss=None` means True for prompt/completion data (TRL's default).
    When `stats` is given the outcome is counted there; otherwise a drop is logged here.
    """
    validate_rows([row], fmt, "example")
    opts = _check_options(
        tokenizer,
        fmt,
        is_conversational(row, fmt),
        completion_only_loss,
        assistant_only_loss,
        truncation,
        add_eos,
        environment_markers,
    )
    ids, labels, outcome = _encode(row, tokenizer, opts, max_length, truncation, char_bound(tokenizer, max_length))
    if stats is not None:
        stats._record(outcome, None)
    elif ids is None:
        logger.warning(
            "dropped an SFT example (%s; max_length=%s)", outcome.replace("_", " "), max_length
        )
    return None if ids is None else {"input_ids": ids, "labels": labels}


def tokenize_dataset(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    fmt: str | None = None,
    max_length: int | None = None,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    truncation: str = "truncate",
    add_eos: bool = True,
    source_name: str | None = None,
    environment_markers: Sequence[str] = (),
) -> tuple[list[dict[str, list[int]]], TokenizeStats]:
    """Validate and tokenize every row (see `tokenize_example`); returns the kept examples
    in order and the counts. Truncations and drops are logged as one warning.

    `fmt=None` detects the format from the first row's columns. An error while encoding
    a row (e.g. the chat template rejects a role) is re-raised naming the row.
    """
    name = source_name or getattr(rows, "name", None) or "dataset"
    if len(rows) == 0:
        raise DataFormatError(f"{name}: no rows")
    fmt = fmt or detect_format(rows[0].keys(), rows[0], first_source(rows) or name)
    validate_rows(rows, fmt, name)
    locate = getattr(rows, "locate", None) or (lambda i: f"{name}: row {i + 1}")
    opts = _check_options(
        tokenizer,
        fmt,
        is_conversational(rows[0], fmt),
        completion_only_loss,
        assistant_only_loss,
        truncation,
        add_eos,
        environment_markers,
    )
    stats, examples, bound = TokenizeStats(), [], char_bound(tokenizer, max_length)
    for i, row in enumerate(rows):
        try:
            ids, labels, outcome = _encode(row, tokenizer, opts, max_length, truncation, bound)
        except Exception as e:
            raise DataFormatError(f"{locate(i)}: cannot tokenize: {e}") from e
        stats._record(outcome, locate(i))
        if ids is not None:
            examples.append({"input_ids": ids, "labels": labels})
    if stats.n_truncated or stats.n_dropped:
        logger.warning(
            "%s: %d of %d rows truncated to max_length=%s, %d dropped as too long, %d dropped "
            "with no trained token left%s",
            name,
            stats.n_truncated,
            stats.n_rows,
            max_length,
            stats.n_dropped_too_long,
            stats.n_dropped_no_loss,
            f" (first: {', '.join(stats.dropped_at)})" if stats.dropped_at else "",
        )
    if not examples:
        raise DataFormatError(
            f"{name}: every one of {stats.n_rows} rows was dropped ({stats.as_dict()})"
        )
    return examples, stats


def pad_collate(
    examples: Sequence[Mapping[str, Sequence[int]]],
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
) -> LMBatch:
    """Right-pad examples into an `LMBatch`.

    `input_ids` (B, T) padded with `pad_token_id`, `attention_mask` (B, T) 1 on real
    tokens, `labels` (B, T) aligned with `input_ids`, -100 on padding and on untrained
    positions (an example without `labels` is trained on every token), `lengths` (B,).
    T is the longest example, rounded up to `pad_to_multiple_of`.
    """
    if not examples:
        raise ValueError("pad_collate got no examples")
    if pad_token_id is None:
        raise ValueError("pad_token_id is None; set tokenizer.pad_token (e.g. to the eos token)")
    T = max(len(ex["input_ids"]) for ex in examples)
    if pad_to_multiple_of:
        T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    B = len(examples)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        input_ids[i, :n] = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.as_tensor(ex.get("labels", ex["input_ids"]), dtype=torch.long)
    return LMBatch(input_ids=input_ids, labels=labels, lengths=attention_mask.sum(1), attention_mask=attention_mask)


def causal_lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and the number of trained tokens.

    sum_nll = Σ_{b, t : labels[b, t+1] ≠ -100} −log softmax(logits[b, t])[labels[b, t+1]]

    Shapes: logits (B, T, V), labels (B, T) aligned with the inputs; returns two scalars
    (sum_nll in float32, n_tokens as int64). Divide the sums over all micro-batches by
    the total count for a token-mean loss that does not depend on how the batch was split
    or padded.
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    sum_nll = F.cross_entropy(
        shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return sum_nll, (shift_labels != IGNORE_INDEX).sum()


def pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def left_pad(
    prompt_ids: list[list[int]], pad_id: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids (B, P) left-padded with pad_id and mask (B, P), 1 = real token."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)
