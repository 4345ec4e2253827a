"""What every synthetic task shares: the final-answer format, option presets, JSONL writing.

A task's completion is a short worked solution whose last line is `Answer: <value>`. The
scorers only read that line, so a model may write any working it likes above it, but the
answer line itself is parsed strictly: `Answer: 12 or 13` is wrong, not half right.
"""

from __future__ import annotations

import json
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

ANSWER_PREFIX = "Answer:"

# Decoding without `skip_special_tokens` leaves markers such as `<|eos|>` (ours),
# `<|endoftext|>`, `<|im_end|>`, `</s>` or `<end_of_turn>`; whatever follows the first one
# was never part of the response (padding, or text sampled past the stop token).
_STOP_MARKER = re.compile(r"<\|[^<>|\s]{1,32}\|>|</s>|<eos>|<end_of_turn>")


def extract_answer(completion: str) -> str | None:
    """The value on the last `Answer:` line of a completion, or None if it is malformed.

    The completion is cut at its first special-token marker, then the text after the LAST
    `Answer:` up to the end of its line is taken and stripped. That line must be the last
    non-blank one (anything after it means the model did not stop), and the value must be
    non-empty and on the same line as `Answer:`; otherwise the completion is malformed.
    """
    text = _STOP_MARKER.split(completion, maxsplit=1)[0]
    start = text.rfind(ANSWER_PREFIX)
    if start < 0:
        return None
    rest = text[start + len(ANSWER_PREFIX) :].rstrip()
    if "\n" in rest or "\r" in rest:
        return None
    return rest.strip() or None


def format_completion(steps: Iterable[str], answer: object) -> str:
    """A worked solution: one step per line, then the answer line."""
    return "\n".join([*steps, f"{ANSWER_PREFIX} {answer}"])


def resolve_options(
    presets: Mapping[str, Mapping[str, Any]], difficulty: str, **explicit: Any
) -> dict[str, Any]:
    """The preset for `difficulty` with every explicit (non-None) option laid over it."""
    if difficulty not in presets:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(presets)}")
    options = {"difficulty": difficulty, **presets[difficulty]}
    options.update({k: v for k, v in explicit.items() if v is not None})
    return options


def int_range(
    value: int | tuple[int, int] | list[int], name: str, lo: int, hi: int
) -> tuple[int, int]:
    """Read an option that is either a count (`3`) or an inclusive range (`(2, 3)`)."""
    first, last = (value, value) if isinstance(value, int) else tuple(value)
    if not (isinstance(first, int) and isinstance(last, int) and lo <= first <= last <= hi):
        raise ValueError(
            f"{name} must be an int or a (min, max) pair within {lo}..{hi}, got {value!r}"
        )
    return first, last


class Task(ABC):
    """A family of generated problems plus the verifier of free-form answers to them.

    Subclasses take their options as keyword arguments, each defaulting to None, meaning
    "whatever the `difficulty` preset says"; they store the resolved values in `options`.
    """

    name: ClassVar[str]
    presets: ClassVar[dict[str, dict[str, Any]]]
    # Which options enlarge the problem space; quoted when `make_task` runs out of prompts.
    grow_hint: ClassVar[str]

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}

    @abstractmethod
    def generate(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        """`n` rows with `prompt`, `answer`, `completion` (and any column the scorer needs).

        Rows may repeat; `make_task` dedupes by prompt.
        """

    @abstractmethod
    def score(self, completion: str, answer: str, /, **row: Any) -> float:
        """1.0 if the completion's final answer is right, else 0.0 (wrong or malformed).

        `completion` and `answer` are positional-only so that a whole row, which has
        `completion` and `answer` columns of its own, can be passed as `**row`.
        """

    def prepare_train(self, rows: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
        """The training split's final form (`make_task` calls it on train only, after every
        split is drawn, so held-out and RL rows never change); the rows as they are by default."""
        return rows

    def extract_answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({args})"


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object per line, UTF-8, keys sorted, so equal rows give equal bytes."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")


def write_splits(out_dir: str | Path, splits: dict[str, list[dict]], meta: dict[str, Any]) -> dict[str, Any]:
    """OUT/<split>.jsonl for each split and OUT/task.json; returns their paths and counts
    ({"train": Path, "n_train": int, ..., "task": Path})."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    for split, rows in splits.items():
        info[split] = out / f"{split}.jsonl"
        info[f"n_{split}"] = len(rows)
        write_jsonl(info[split], rows)
    info["task"] = out / "task.json"
    info["task"].write_text(json.dumps(meta, sort_keys=True, indent=2) + "\n", encoding="utf-8")
    return info
