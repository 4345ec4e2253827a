"""Synthetic preference pairs for a bundled task: a right completion as `chosen`, a wrong one as `rejected`.

    make_preferences("arithmetic", "data/arith_pref", n_train=5000, seed=0)  # constructed
    make_preferences("arithmetic", "data/arith_pref", sample=sample)          # sampled by `sample`

`posttrain.sample_preferences` samples from a model (`sample_preferences(task, out_dir,
"runs/sft/final", samples=8)`): loading models and running engines is a command's work, so
this module only turns the samples it is given into pairs.

Writes `train.jsonl` and `test.jsonl` (columns prompt, chosen, rejected, answer, task, source,
and `error` for constructed pairs, `form` too with `bare_fraction`) and `preferences.json`
(settings and counts). The same arguments give the same bytes. Test prompts are drawn first
and never appear in train; with the same seed, options and n_test they are exactly
`make_task`'s test prompts, so the problems an SFT run holds out stay held out from the pairs
too.

Two sources:
- constructed (no model): chosen is the task's worked completion; rejected is the same
  solution with one realistic mistake made by a seeded rng (`ERRORS`): a step result off by
  one, a dropped or extra carry (±10), one wrong digit, the result of the wrong operator, or
  a right working with a mistyped final answer. A mistake in a step is carried through the
  later steps, as a person's would be, so the working stays self-consistent. Every rejected
  completion scores 0 with the task's scorer (checked). With `bare_fraction` > 0 either side
  may be written without its steps (the answer line alone), and a guessed final answer joins
  the mistakes (see `arithmetic_pair`). Arithmetic only.
- sampled (`sample`, a `Sample`: K completions per prompt, e.g. drawn from a model at
  temperature 1 by `posttrain.sample_preferences`), scored with the task's scorer; a prompt
  with at least one right and one wrong sample gives a pair (the first of each, a
  wrong sample that stopped on its own preferred). The test split holds the pairs found among
  the `n_test` held-out prompts (fewer than n_test pairs when some prompts are all right or all
  wrong); training prompts are drawn in rounds until `n_train` pairs exist or
  `max_prompts_factor` × n_train prompts were tried. The counts of prompts tried, all right and
  all wrong are reported. Any task.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from posttrain.data.tasks import _draw_unique, get_task
from posttrain.data.tasks.base import Task, format_completion, write_jsonl

_TOKEN = re.compile(r"\d+|[+\-*]")
_APPLY: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

Mistake = Callable[[int, str, int, int, random.Random], int]
"""(a, op, b, right result, rng) -> a wrong result of the step `a op b`."""


def _off_by_one(a: int, op: str, b: int, value: int, rng: random.Random) -> int:
    return value + rng.choice((-1, 1))


def _carry(a: int, op: str, b: int, value: int, rng: random.Random) -> int:
    return value + rng.choice((-10, 10))


def _digit(a: int, op: str, b: int, value: int, rng: random.Random) -> int:
    digits = list(str(abs(value)))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return (-1 if value < 0 else 1) * int("".join(digits))


def _operator(a: int, op: str, b: int, value: int, rng: random.Random) -> int:
    return _APPLY[rng.choice([o for o in "+-*" if o != op])](a, b)


ERRORS: dict[str, Mistake] = {
    "off_by_one": _off_by_one,
    "carry": _carry,
    "digit": _digit,
    "operator": _operator,
}
"""Mistakes made in one step of an arithmetic solution (or in its final answer: `answer_typo`)."""


def solve_with_mistake(nums: list[int], ops: list[str], at: int | None = None,
                       mistake: Callable[[int, str, int, int], int] | None = None) -> tuple[int, list[str]]:
    """`arithmetic.solve` with step number `at` (0-based, in solving order) replaced by
    `mistake(a, op, b, right)`; later steps use the wrong value. Returns (value, step lines)."""
    steps, terms, signs, k = [], [nums[0]], [], 0

    def step(a: int, op: str, b: int) -> int:
        nonlocal k
        value = _APPLY[op](a, b)
        if k == at:
            value = mistake(a, op, b, value)
        k += 1
        steps.append(f"{a}{op}{b}={value}")
        return value

    for op, x in zip(ops, nums[1:]):
        if op == "*":
            terms[-1] = step(terms[-1], op, x)
        else:
            terms.append(x)
            signs.append(op)
    acc = terms[0]
    for op, x in zip(signs, terms[1:]):
        acc = step(acc, op, x)
    return acc, steps


def _guess(nums: list[int], right: int, rng: random.Random) -> int:
    """A final answer not computed from the problem (0, 1 or one of its numbers), not `right`."""
    options = sorted({0, 1, nums[0], nums[-1]} - {right})
    return rng.choice(options) if options else right + 1


def arithmetic_pair(
    row: Mapping[str, Any], rng: random.Random, bare_fraction: float = 0.0
) -> tuple[str, str, dict]:
    """(chosen, rejected, columns) for an arithmetic row: its worked solution, and the same
    solution with one mistake; columns = {"error": the mistake} (and "form", below).

    Both show their steps (three or more operands; two-operand problems show the answer line
    only, as `ArithmeticTask`), whatever share of the task's demonstrations skip them
    (`worked` < 1): a rejected solution that shows steps against a chosen one that does not
    would let a reward model prefer the shorter text without checking any arithmetic. Draws a
    mistake (one of `ERRORS` at a random step, or `answer_typo`: right steps, a final answer
    off by one) until the final answer differs from the right one.

    bare_fraction > 0: each side is written bare (the answer line alone) with this
    probability, drawn for chosen and rejected independently, and recorded as
    columns["form"] = "<chosen form>/<rejected form>" ("worked" or "bare"). At 0.5 the four
    combinations are equally likely, so a reward model cannot rank by form and must check
    bare answers too, which a policy that drops its working would otherwise exploit. Mistakes
    then also include `guess`: right steps with a final answer not computed from the problem
    (0, 1, or one of its numbers: the answers such a policy falls back on).
    """
    tokens = _TOKEN.findall(row["prompt"])
    nums, ops = [int(t) for t in tokens[::2]], tokens[1::2]
    right, right_steps = solve_with_mistake(nums, ops)
    if right != int(row["answer"]):
        raise ValueError(f"arithmetic row {row['prompt']!r}: answer {row['answer']!r}, but the steps give {right}")
    show_steps = len(nums) >= 3
    kinds = [*ERRORS, "answer_typo"] if show_steps else list(ERRORS)
    if bare_fraction > 0:
        kinds.append("guess")
    while True:
        kind = rng.choice(kinds)
        if kind == "answer_typo":
            value, steps = _off_by_one(0, "+", 0, right, rng), right_steps
        elif kind == "guess":
            value, steps = _guess(nums, right, rng), right_steps
        else:
            at = rng.randrange(len(ops))
            value, steps = solve_with_mistake(nums, ops, at, partial(ERRORS[kind], rng=rng))
        if value != right:
            break
    # No draw at bare_fraction 0: the pairs stay those made before the option existed.
    worked = [show_steps and not (bare_fraction > 0 and rng.random() < bare_fraction) for _ in range(2)]
    columns = {"error": kind}
    if bare_fraction > 0:
        columns["form"] = "/".join("worked" if w else "bare" for w in worked)
    chosen = format_completion(right_steps if worked[0] else [], right)
    return chosen, format_completion(steps if worked[1] else [], value), columns


PairMaker = Callable[[Mapping[str, Any], random.Random, float], tuple[str, str, dict]]
"""row, rng, bare_fraction -> (chosen, rejected, extra columns of the pair)."""

PAIR_MAKERS: dict[str, PairMaker] = {"arithmetic": arithmetic_pair}
"""Tasks whose pairs can be constructed without a model."""


def _constructed(task: Task, rows: list[dict], rng: random.Random, per_prompt: int = 1,
                 bare_fraction: float = 0.0) -> list[dict]:
    """`per_prompt` pairs of each row: its right completion against that many different
    wrong ones (fewer when the task's mistakes run out: 20 draws per pair at most)."""
    if task.name not in PAIR_MAKERS:
        raise ValueError(
            f"constructed pairs exist for {', '.join(PAIR_MAKERS)}; for {task.name!r} pass a model to sample from"
        )
    pairs = []
    for row in rows:
        seen: set[str] = set()
        for _ in range(20 * per_prompt):
            chosen, rejected, columns = PAIR_MAKERS[task.name](row, rng, bare_fraction)
            if rejected in seen:
                continue
            if task.score(chosen, row["answer"]) != 1.0 or task.score(rejected, row["answer"]) != 0.0:
                raise RuntimeError(
                    f"constructed pair for {row['prompt']!r} is not right/wrong: {chosen!r} / {rejected!r}"
                )
            seen.add(rejected)
            pairs.append(_pair(row, task, chosen, rejected, "constructed", **columns))
            if len(seen) == per_prompt:
                break
    return pairs


def _pair(row: Mapping[str, Any], task: Task, chosen: str, rejected: str, source: str, **extra: Any) -> dict:
    extras = {k: v for k, v in row.items() if k not in ("prompt", "completion", "answer")}
    return {"prompt": row["prompt"], "chosen": chosen, "rejected": rejected, "answer": row["answer"],
            **extras, "task": task.name, "source": source, **extra}


Sample = Callable[[list[str]], list[list[tuple[str, str]]]]
"""prompts -> for each prompt its K samples as (text, finish_reason): "stop" when the sample
ended on its own, "length" when it hit the token limit."""


class _Sampler:
    """Turns prompts into pairs from `sample`'s completions, `batch_size` prompts a call."""

    def __init__(self, sample: Sample, batch_size: int):
        self.sample, self.batch_size = sample, batch_size
        self.counts = {"prompts": 0, "all_right": 0, "all_wrong": 0}

    def pairs(self, task: Task, rows: list[dict]) -> list[dict]:
        out = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            for row, samples in zip(chunk, self.sample([r["prompt"] for r in chunk]), strict=True):
                pair = self._pair(task, row, samples)
                if pair is not None:
                    out.append(pair)
        return out

    def _pair(self, task: Task, row: dict, samples: list[tuple[str, str]]) -> dict | None:
        extras = {k: v for k, v in row.items() if k not in ("prompt", "completion", "answer")}
        right = [t for t, _ in samples if task.score(t, row["answer"], **extras) == 1.0]
        wrong = [(r != "stop", t) for t, r in samples if task.score(t, row["answer"], **extras) != 1.0]
        self.counts["prompts"] += 1
        self.counts["all_right"] += not wrong
        self.counts["all_wrong"] += not right
        if not right or not wrong:
            return None
        return _pair(row, task, right[0], min(wrong, key=lambda w: w[0])[1], "sampled")

    def collect(self, task: Task, n: int, rng: random.Random, seen: set[str], factor: int) -> list[dict]:
        """Draw fresh prompts in rounds until `n` pairs, or `factor · n` prompts were tried."""
        pairs: list[dict] = []
        tried = 0
        while len(pairs) < n and tried < factor * n:
            want = min(max(2 * (n - len(pairs)), self.batch_size), factor * n - tried)
            rows = _draw_unique(task, want, rng, seen, want)
            tried += len(rows)
            pairs += self.pairs(task, rows)
        return pairs[:n]


def make_preferences(
    task: str,
    out_dir: str | Path,
    n_train: int = 5000,
    n_test: int = 500,
    seed: int = 0,
    sample: Sample | None = None,
    batch_size: int = 64,
    max_prompts_factor: int = 20,
    pairs_per_prompt: int = 1,
    bare_fraction: float = 0.0,
    sample_meta: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Write preference pairs for `task` into `out_dir` (see the module doc).

    `options` are the task's (e.g. difficulty="easy"). `pairs_per_prompt` > 1 (constructed
    pairs only) gives each training prompt that many different wrong completions against its
    right one, so n_train pairs come from n_train / pairs_per_prompt prompts: more distinct
    pairs than a task has prompts. The test split keeps one pair per prompt, so held-out
    figures do not depend on it. `bare_fraction` (constructed pairs only; both splits) writes
    each side without its steps with that probability (`arithmetic_pair`). `sample` (see
    `Sample`) makes sampled pairs instead, asked for `batch_size` prompts at a time;
    `sample_meta` is what preferences.json records of it (`sample_preferences`: "model" and
    "samples"; None for both when absent). Returns {"train",
    "test", "meta": Path, "n_train", "n_test": pairs written, and, when sampled, "counts"}.
    """
    if n_train < 0 or n_test < 0 or pairs_per_prompt < 1:
        raise ValueError(f"need n_train, n_test >= 0 and pairs_per_prompt >= 1; "
                         f"got {n_train}, {n_test}, {pairs_per_prompt}")
    if sample is not None and pairs_per_prompt != 1:
        raise ValueError("pairs_per_prompt > 1 is for constructed pairs; sampled pairs are one per prompt "
                         "(drop the model, or pairs_per_prompt)")
    if not 0 <= bare_fraction <= 1:
        raise ValueError(f"bare_fraction must be in [0, 1], got {bare_fraction}")
    if sample is not None and bare_fraction > 0:
        raise ValueError("bare_fraction is for constructed pairs; sampled pairs are the model's own text "
                         "(drop the model, or bare_fraction)")
    t = get_task(task, **options)
    rng, seen = random.Random(seed), set()
    n_prompts = -(-n_train // pairs_per_prompt) + n_test  # ceil: what the splits ask of the task
    sampler = _Sampler(sample, batch_size) if sample is not None else None
    splits = {}
    for split, n in (("test", n_test), ("train", n_train)):  # test first: it never depends on n_train
        if sampler is None:
            k = pairs_per_prompt if split == "train" else 1
            prompts = _draw_unique(t, -(-n // k), rng, seen, n_prompts)
            splits[split] = _constructed(t, prompts, rng, k, bare_fraction)[:n]
        elif split == "test":  # exactly the held-out prompts, whatever the yield
            splits[split] = sampler.pairs(t, _draw_unique(t, n, rng, seen, n_prompts))
        else:
            splits[split] = sampler.collect(t, n, rng, seen, max_prompts_factor)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl", "meta": out / "preferences.json"}
    for split in ("train", "test"):
        write_jsonl(paths[split], splits[split])
    counts = {split: len(rows) for split, rows in splits.items()}
    meta = {"task": task, "options": t.options, "seed": seed, "source": "sampled" if sampler else "constructed",
            "model": None, "samples": None, **(sample_meta or {}), "counts": counts,
            "pairs_per_prompt": pairs_per_prompt,
            **({"bare_fraction": bare_fraction} if bare_fraction > 0 else {}),
            **({"sampling": sampler.counts} if sampler else {})}
    paths["meta"].write_text(json.dumps(meta, sort_keys=True, indent=2) + "\n", encoding="utf-8")
    result = {**paths, "n_train": counts["train"], "n_test": counts["test"]}
    if sampler is not None:
        result["counts"] = sampler.counts
    return result
