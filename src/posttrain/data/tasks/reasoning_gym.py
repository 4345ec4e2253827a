"""reasoning-gym datasets as posttrain tasks: `posttrain data make rg:<name>`.

    make_rg_task("rg:basic_arithmetic", "data/rg_arith", n_train=1000, n_test=100, seed=0,
                 max_terms=3)
    # data/rg_arith/{train,test}.jsonl and task.json; rows like
    # {"prompt": "Calculate 5 - 3 - 6.\n\nEnd your response with ... Answer: <your answer>",
    #  "answer": "-4", "completion": "Answer: -4", "task": "rg:basic_arithmetic",
    #  "question": "Calculate 5 - 3 - 6.", "metadata": "{\"expression\": \"5 - 3 - 6\", ...}"}

reasoning-gym (`pip install 'posttrain[tasks]'`) generates about a hundred procedural
datasets, each with its own verifier. Rows carry what `task_reward` needs to rebuild the
entry its verifier takes: `question` (the raw question; `prompt` adds the answer
instruction), `answer`, and `metadata` as a JSON string (the nested dicts differ from row
to row, which Arrow-backed loaders cannot type as one column). `task_reward` scores
`score_answer(extract_final_answer(completion), entry)`; verifiers may give partial credit
(a number in [0, 1]).

Options: every field of the dataset's reasoning-gym config (e.g. `max_terms=3`), plus
`answer_format`: `line` (default) asks for a last line `Answer: <answer>`, the format of
the bundled tasks; `tag` asks for `<answer>...</answer>` (reasoning-gym's and DeepSeek-R1's
convention), which also holds answers that span several lines.

Splits: reasoning-gym draws entry i of a dataset from `Random(seed + i)`, so two seeds
share most entries (seed 1's entry 0 is seed 0's entry 1). Both files therefore come from
one generated sequence: the test split is its first `n_test` distinct questions (so it
does not change with `n_train`), the train split the next `n_train` distinct questions,
never one of the test questions.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from posttrain.data.tasks.base import ANSWER_PREFIX, write_splits

PREFIX = "rg:"
INSTALL_HINT = "pip install 'posttrain[tasks]'"

ANSWER_FORMATS = {
    "line": (f'End your response with a line of the form "{ANSWER_PREFIX} <your answer>".', f"{ANSWER_PREFIX} {{}}"),
    "tag": ("Put your final answer inside <answer></answer> tags.", "<answer>{}</answer>"),
}
"""answer_format -> (instruction appended to the question, reference completion template)."""


def registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's datasets: name -> (dataset class, config dataclass)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ImportError(f"reasoning-gym tasks (rg:<name>) need reasoning-gym: {INSTALL_HINT}") from None
    return DATASETS


def dataset_name(task: str) -> str:
    """`rg:basic_arithmetic` -> `basic_arithmetic`, checked against reasoning-gym's registry."""
    name = task.removeprefix(PREFIX)
    datasets = registry()
    if name not in datasets:
        near = difflib.get_close_matches(name, list(datasets), n=5, cutoff=0.5)
        listed = near if near else sorted(datasets)
        what = "did you mean" if near else "available"
        raise ValueError(f"unknown reasoning-gym dataset {name!r}; {what}: {', '.join(PREFIX + n for n in listed)}")
    return name


def create_dataset(name: str, size: int, seed: int, options: dict[str, Any]) -> Any:
    """`reasoning_gym.create_dataset(name, size=size, seed=seed, **options)` with readable errors."""
    config_cls = registry()[name][1]
    valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"rg:{name} has no option {', '.join(unknown)}; its options: "
            f"{', '.join(valid + ['answer_format'])}"
        )
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    except (AssertionError, TypeError, ValueError) as err:  # reasoning-gym validates with assert
        raise ValueError(f"rg:{name} rejects options {options}: {err or type(err).__name__}") from None


def distinct_entries(name: str, count: int, seed: int, options: dict[str, Any]) -> list[dict]:
    """The first `count` entries with distinct questions of the dataset's sequence for `seed`.

    Walks indices 0, 1, 2, ...; the space counts as exhausted once `max(1000, count)`
    indices in a row bring no new question.
    """
    size = max(count, 1)
    dataset = create_dataset(name, size, seed, options)
    entries: list[dict] = []
    seen: set[str] = set()
    index, patience = 0, max(1000, count)
    stale = patience
    while len(entries) < count:
        if index == size:  # entry i depends on seed + i only, so a bigger dataset extends this one
            size *= 2
            dataset = create_dataset(name, size, seed, options)
        entry = dataset[index]
        index += 1
        if entry["question"] in seen:
            stale -= 1
            if stale == 0:
                raise ValueError(
                    f"rg:{name} with {options} has too few distinct questions: found {len(seen)} "
                    f"of the {count} requested (n_train + n_test); widen its options or lower n_train/n_test"
                )
            continue
        seen.add(entry["question"])
        entries.append(entry)
        stale = patience
    return entries


def to_row(task: str, entry: dict, answer_format: str) -> dict[str, Any]:
    """A JSONL row for one reasoning-gym entry (see the module docstring for the columns)."""
    instruction, completion = ANSWER_FORMATS[answer_format]
    answer = str(entry["answer"])
    if answer_format == "line" and "\n" in answer.strip():
        raise ValueError(
            f"{task} has answers that span several lines, which an `{ANSWER_PREFIX}` line cannot "
            "hold; use answer_format=tag"
        )
    return {
        "prompt": f"{entry['question'].rstrip()}\n\n{instruction}",
        "answer": answer,
        "completion": completion.format(answer),
        "task": task,
        "question": entry["question"],
        "metadata": json.dumps(entry.get("metadata") or {}, sort_keys=True, default=_jsonable),
    }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def make_rg_task(
    task: str,
    out_dir: str | Path,
    n_train: int = 10_000,
    n_test: int = 500,
    seed: int = 0,
    n_rl: int = 0,
    answer_format: str = "line",
    **options: Any,
) -> dict[str, Any]:
    """Write `train.jsonl`, `test.jsonl` (and `rl.jsonl` when n_rl > 0) and `task.json` for
    `rg:<name>` into `out_dir`.

    Same contract as `posttrain.data.tasks.make_task` (which this mirrors for reasoning-gym):
    deterministic for a seed, questions distinct across the files, test drawn first, then RL.

    Returns:
        {"train": Path, "test": Path, "task": Path, "n_train": int, "n_test": int}, plus
        "rl" and "n_rl" when n_rl > 0.
    Raises:
        ImportError: reasoning-gym is not installed.
        ValueError: unknown dataset (the message lists close names) or option, an answer
            `answer_format=line` cannot hold, or too few distinct questions.
    """
    if min(n_train, n_test, n_rl) < 0:
        raise ValueError(f"n_train, n_test and n_rl must be >= 0, got {n_train}, {n_test} and {n_rl}")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
    name = dataset_name(task)
    task = PREFIX + name
    entries = distinct_entries(name, n_test + n_rl + n_train, seed, options)
    rows = [to_row(task, entry, answer_format) for entry in entries]
    splits = {"test": rows[:n_test]}
    if n_rl:
        splits["rl"] = rows[n_test : n_test + n_rl]
    splits["train"] = rows[n_test + n_rl :]
    meta = {
        "name": task,
        "options": {"answer_format": answer_format, **options},
        "seed": seed,
        "counts": {k: len(v) for k, v in splits.items()},
        "source": f"reasoning-gym {importlib.metadata.version('reasoning-gym')}",
    }
    return write_splits(out_dir, splits, meta)
