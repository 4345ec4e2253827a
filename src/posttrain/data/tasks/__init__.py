"""Bundled synthetic tasks with verifiable answers: one task and its scorer per file.

    task = get_task("arithmetic", difficulty="easy")
    rows = task.generate(4, random.Random(0))        # prompt / answer / completion (+ extras)
    task.score("12+30=42\\nAnswer: 42", "42")         # 1.0

    make_task("countdown", "data/countdown", n_train=10_000, seed=0)
    # data/countdown/{train,test}.jsonl and task.json, the same bytes for the same seed

Every completion ends with the line `Answer: <value>` (see `base.extract_answer`).
"""

from __future__ import annotations

import difflib
import inspect
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.data.tasks.arithmetic import ArithmeticTask
from posttrain.data.tasks.arithmetic_tools import ArithmeticToolsTask
from posttrain.data.tasks.base import Task, extract_answer, write_splits
from posttrain.data.tasks.countdown import CountdownTask

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ArithmeticTask, ArithmeticToolsTask, CountdownTask)}

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "ArithmeticToolsTask",
    "CountdownTask",
    "Task",
    "extract_answer",
    "get_task",
    "make_task",
    "score_completions",
]


def _unknown(kind: str, name: str, valid: Sequence[str]) -> ValueError:
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ValueError(f"unknown {kind} {name!r}{hint}; valid: {', '.join(valid)}")


def get_task(name: str, **options: Any) -> Task:
    """The task registered as `name`, built with `options` (see each task's docstring)."""
    if name not in TASKS:
        raise _unknown("task", name, sorted(TASKS))
    cls = TASKS[name]
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in options:
        if key not in valid:
            raise _unknown(f"option of task {name!r}:", key, valid)
    return cls(**options)


def make_task(
    name: str,
    out_dir: str | Path,
    n_train: int = 8_000,
    n_test: int = 500,
    seed: int = 0,
    n_rl: int = 0,
    **options: Any,
) -> dict[str, Any]:
    """Write `train.jsonl`, `test.jsonl` and `task.json` for a task into `out_dir`, and
    `rl.jsonl` when `n_rl` > 0: prompts for online RL that neither the SFT rows (train)
    nor the held-out rows (test) contain, as a pipeline that fine-tunes on one set and
    runs RL on fresh prompts wants.

    Each row also gets a `task` column with the task's name. Prompts are unique across all
    files. The test split is drawn first, then the RL split, then train: test depends only
    on (name, options, seed, n_test), and growing `n_train` never changes test or RL.

    Returns:
        {"train": Path, "test": Path, "task": Path, "n_train": int, "n_test": int}, plus
        "rl" and "n_rl" when n_rl > 0.
    Raises:
        ValueError: unknown task or option, or a problem space too small for
            `n_train + n_test + n_rl` distinct prompts (the message names the options to change).
    """
    if min(n_train, n_test, n_rl) < 0:
        raise ValueError(f"n_train, n_test and n_rl must be >= 0, got {n_train}, {n_test} and {n_rl}")
    task = get_task(name, **options)
    rng, seen, requested = random.Random(seed), set(), n_train + n_test + n_rl
    splits = {"test": _draw_unique(task, n_test, rng, seen, requested)}
    if n_rl:
        splits["rl"] = _draw_unique(task, n_rl, rng, seen, requested)
    splits["train"] = task.prepare_train(_draw_unique(task, n_train, rng, seen, requested), rng)
    for rows in splits.values():
        for row in rows:  # lets `task_reward` and `posttrain eval` find the scorer
            row["task"] = name
    meta = {"name": name, "options": task.options, "seed": seed, "counts": {k: len(v) for k, v in splits.items()}}
    return write_splits(out_dir, splits, meta)


def _draw_unique(
    task: Task, n: int, rng: random.Random, seen: set[str], requested: int
) -> list[dict]:
    """`n` rows whose prompts are not in `seen` (which they join).

    The space counts as exhausted once `max(1000, n)` draws in a row bring nothing new.
    """
    rows: list[dict] = []
    patience = stale = max(1000, n)
    while len(rows) < n:
        for row in task.generate(n - len(rows), rng):
            if row["prompt"] in seen:
                stale -= 1
                if stale == 0:
                    raise ValueError(
                        f"task {task.name!r} with {task.options} has too few distinct prompts: found "
                        f"{len(seen)} of the {requested} requested (n_train + n_test); {task.grow_hint}, "
                        "or lower n_train/n_test"
                    )
                continue
            seen.add(row["prompt"])
            rows.append(row)
            stale = patience
    return rows


def score_completions(
    task: str | Task,
    completions: Sequence[str],
    answers: Sequence[str],
    rows: Sequence[Mapping[str, Any]] | None = None,
) -> list[float]:
    """Score each completion against its answer; `rows` give extra columns (countdown's `numbers`)."""
    task = get_task(task) if isinstance(task, str) else task
    rows = rows if rows is not None else [{}] * len(completions)
    if not len(completions) == len(answers) == len(rows):
        raise ValueError(
            f"lengths differ: {len(completions)} completions, {len(answers)} answers, {len(rows)} rows"
        )
    return [task.score(c, a, **row) for c, a, row in zip(completions, answers, rows)]
