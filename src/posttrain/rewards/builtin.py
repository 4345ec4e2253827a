"""Built-in reward functions, each with TRL's signature (or a factory returning one).

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

Dataset columns arrive as keyword lists aligned with `completions` (`answer=[...]`,
`tests=[...]`, `task=[...]`). A completion may be a string or, in TRL's conversational
format, a list of messages (the last message's `content` is scored). None means "not
applicable to this sample" (see `posttrain.rewards.runner` for how it is combined).

    name              kind      checks                                            column(s)
    math_accuracy     function  math-verify equivalence of the final answer       answer
    exact_match       function  normalised string equality of the final answer    answer
    env_reward        function  a multi-turn episode's environment reward         env_reward (the rollout's)
    format_reward     factory   the completion matches a regex (think/answer)     -
    overlong_penalty  factory   DAPO's soft length punishment (eq. 13)            (completion_ids)
    task_reward       factory   the scorer of a bundled task or `rg:<name>`       answer, task
    code_tests        function  fraction of the row's asserts the code passes     tests
    llm_judge         factory   an OpenAI-compatible judge's 0..max_score grade   answer (optional)
    reward_model      factory   a trained reward model's score of prompt + completion   -

A factory is called to get the function: `format_reward(pattern=...)`. The registry does
that for you from a name or a `{"name": ..., **options}` dict.

Correctness: math_accuracy, exact_match, task_reward and code_tests set `is_correctness =
True` (1.0 means right; for code_tests, every test passed). The RL trainers' `accuracy` metric
comes from the first function that declares it and is absent without one
(`posttrain.workers.reward_worker`); a user's function declares it the same way:
`my_reward.is_correctness = True`.

Each factory's function carries `reward_spec`, the `reward.functions` entry that builds it
again (`"format_reward"`, `{name: task_reward, task: arithmetic}`), so a run given it from
Python records it in config.yaml (`posttrain.rewards.registry.describe_reward`).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch

from posttrain.algos.dapo import overlong_penalty as _dapo_overlong_penalty
from posttrain.rewards.base import RUN_KWARGS, completion_text
from posttrain.rewards.judge import llm_judge
from posttrain.rewards.reward_model import reward_model

__all__ = [
    "BUILTIN_REWARDS",
    "REWARD_FACTORIES",
    "code_tests",
    "completion_text",
    "env_reward",
    "exact_match",
    "extract_code",
    "extract_final_answer",
    "format_reward",
    "math_accuracy",
    "normalize_answer",
    "overlong_penalty",
    "task_reward",
]

Rewards = list[float | None]

# Beyond this many characters an answer is not a short final answer; the cap also keeps
# sympy away from the huge expressions that can make it run for minutes.
MAX_ANSWER_CHARS = 1000
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_LINE = re.compile(r"answer\s*(?:is|:)\s*([^\n]+)", re.IGNORECASE)
_THINK_END = "</think>"
_MATHY = re.compile(r"[0-9\\]")


def _plain(value: Any) -> bool:
    """A value config.yaml can hold as it is."""
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    return value is None or isinstance(value, (str, int, float, bool))


def _records_spec(factory: Callable[..., Any]) -> Callable[..., Any]:
    """Give the function `factory` makes a `reward_spec`: the factory's name, with the options
    it was called with, when config.yaml can hold them (else none: it is then not loadable by name)."""

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        fn = factory(*args, **kwargs)
        options = inspect.signature(factory).bind(*args, **kwargs).arguments
        if all(map(_plain, options.values())):
            fn.reward_spec = {"name": factory.__name__, **options} if options else factory.__name__
        return fn

    return make


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


def extract_final_answer(text: str) -> str | None:
    """The final answer a completion states, or None if it states none explicitly.

    Looked for in this order: the last `<answer>...</answer>`, the last `\\boxed{...}`, the
    rest of the line after the last "answer:" / "answer is" (case-insensitive). Reasoning
    inside `<think>...</think>` is skipped when there is text after it.
    """
    if _THINK_END in text:
        after = text.rsplit(_THINK_END, 1)[1]
        text = after if after.strip() else text
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(text)
    return lines[-1].strip() if lines else None


def normalize_answer(text: str) -> str:
    """Lowercase, collapse whitespace, strip; drop one trailing period and `$...$` math marks."""
    text = " ".join(text.split()).lower()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text.removesuffix(".").rstrip()


def exact_match(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> Rewards:
    """1.0 if the completion's final answer equals `answer` after `normalize_answer`, else 0.0.

    The final answer is `extract_final_answer`'s, or the whole completion when it states none
    (so a bare "Paris" matches "paris."). A None answer gives None (not applicable).
    """
    out: Rewards = []
    for completion, gold in zip(completions, answer):
        if gold is None:
            out.append(None)
            continue
        text = completion_text(completion)
        pred = extract_final_answer(text)
        pred = text if pred is None else pred
        out.append(float(normalize_answer(pred) == normalize_answer(str(gold))))
    return out


exact_match.is_correctness = True


def env_reward(completions: Sequence[Any], env_reward: Sequence[float | None], **kwargs: Any) -> Rewards:
    """The episode's environment reward (the sum of its steps' rewards, `posttrain.envs`), as
    the rollout puts it in the `env_reward` column; None where the environment gave none.
    With it in `reward.functions`, `reward.weights` weighs it against the other functions."""
    return [None if r is None or r != r else float(r) for r in env_reward]


env_reward.required_columns = {"env_reward": "the rollout fills it in episodes: set rollout.env or rollout.tools"}


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns once that its signal-based timeout is off: the runner's is on instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@cache
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutNotice())
    return parse, verify


def _parse_math(text: str) -> list[Any]:
    # math-verify's own timeouts use SIGALRM, which only works on the main thread; reward
    # functions run on worker threads, so they are off and the runner's timeout applies.
    parse, _ = _math_verify()
    found = parse(text, parsing_timeout=None)
    # Bare LaTeX such as `(x+1)^2` needs `$...$` to be read, but words must not become
    # products of symbols (`paris` → p·a·r·i·s), so only text with a digit or a command is.
    if not found and _MATHY.search(text):
        found = parse(f"${text}$", parsing_timeout=None)
    return found


def math_accuracy(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> Rewards:
    """1.0 if the completion's final answer is mathematically equal to `answer`, else 0.0.

    Uses math-verify (`parse` then `verify(gold, pred)`), so `\\frac{1}{2}`, `1/2` and `0.5`
    are the same answer, as are `x^2+2x+1` and `(x+1)^2`. The predicted answer is, in order:
    the last `<answer>` tag, the last `\\boxed{}`, the text after the last "Answer:"; with
    none of these, math-verify reads the whole completion (its last number or expression).
    A gold answer math-verify cannot parse is compared as text (`normalize_answer`); a None
    gold gives None. Answers longer than `MAX_ANSWER_CHARS` score 0.0 unparsed.

    math-verify can be slow, or hang, on adversarial input; its signal-based timeout cannot
    run off the main thread, so this relies on the runner's timeout (see runner.py).
    """
    _, verify = _math_verify()
    out: Rewards = []
    for completion, gold in zip(completions, answer):
        if gold is None:
            out.append(None)
            continue
        text = completion_text(completion)
        pred = extract_final_answer(text)
        if pred is None:  # let math-verify find the last expression near the end
            pred = text[-MAX_ANSWER_CHARS:]
        gold = str(gold)
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            out.append(0.0)
            continue
        gold_parsed = _parse_math(gold)
        if not gold_parsed:
            out.append(float(normalize_answer(pred) == normalize_answer(gold)))
            continue
        pred_parsed = _parse_math(pred)
        out.append(
            float(bool(pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=None))
        )
    return out


math_accuracy.is_correctness = True


@_records_spec
def format_reward(
    pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$",
) -> Callable[..., Rewards]:
    """Factory: 1.0 if the whole completion (stripped) matches `pattern` (re.DOTALL), else 0.0.

    The default asks for DeepSeek-R1's `<think>...</think><answer>...</answer>` layout.
    """
    regex = re.compile(pattern, re.DOTALL)

    def format_reward(completions: Sequence[Any], **kwargs: Any) -> Rewards:
        return [float(regex.match(completion_text(c).strip()) is not None) for c in completions]

    return format_reward


@_records_spec
def overlong_penalty(max_len: int, buffer_len: int, penalty: float = 1.0) -> Callable[..., Rewards]:
    """Factory: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) on token lengths.

    With L = len(completion_ids[i]), L_max = max_len, L_cache = buffer_len:
        0 if L ≤ L_max − L_cache;  ((L_max − L_cache) − L) / L_cache · penalty up to L_max;
        −penalty beyond. Add it to the task reward with weight 1 (TRL's
    `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`).
    """
    _dapo_overlong_penalty(torch.zeros(0), max_len, buffer_len, penalty)  # validates now

    def overlong_penalty(
        completion_ids: Sequence[Sequence[int]] | None = None, **kwargs: Any
    ) -> Rewards:
        if completion_ids is None:
            raise ValueError("overlong_penalty needs completion_ids (token ids of each completion)")
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return _dapo_overlong_penalty(lengths, max_len, buffer_len, penalty).tolist()

    return overlong_penalty


@_records_spec
def task_reward(task: str | None = None) -> Callable[..., Rewards]:
    """Factory: score each completion with its task's scorer (1.0 right, 0.0 wrong).

    The task is the `task=` option, else the row's `task` column; a bundled task name
    (`arithmetic`, `countdown`; see `posttrain.data.tasks`) or `rg:<name>` for a
    reasoning-gym dataset (needs `pip install 'posttrain[tasks]'`). The task's `score` gets the
    row's columns (countdown reads `numbers`); reasoning-gym's `score_answer` gets
    `extract_final_answer(completion)` (the last `<answer>` tag first) and the entry
    {question (column, else the prompt), answer, metadata} rebuilt from the row (`metadata`
    may be a JSON string, as datasets store it). A row without a task gives None; data
    without a `task` column is refused before the run (`required_columns`, read by
    `posttrain.rewards.checks.check_reward_signature`).
    """
    if task is not None:
        _scorer(task)  # fail on a bad name now, not at the first batch

    def task_reward(
        prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **columns: Any
    ) -> Rewards:
        columns.pop("completion_ids", None)
        tasks = [task] * len(completions) if task is not None else columns.get("task")
        if tasks is None:
            raise ValueError("task_reward needs a `task` column or task_reward(task=...)")
        out: Rewards = []
        for i, (completion, name) in enumerate(zip(completions, tasks)):
            if not name:
                out.append(None)
                continue
            row = {k: v[i] for k, v in columns.items() if v is not None and k not in RUN_KWARGS}
            text, prompt = completion_text(completion), completion_text(prompts[i])
            out.append(_scorer(name)(text, answer[i], prompt, row))
        return out

    task_reward.is_correctness = True
    if task is None:
        task_reward.required_columns = {"task": "add it, or name the task: {name: task_reward, task: arithmetic}"}
    return task_reward


@cache
def _scorer(name: str) -> Callable[[str, Any, str, dict], float]:
    """(completion, answer, prompt, row) -> score, for a bundled task or `rg:<dataset>`."""
    if name.startswith("rg:"):
        return _reasoning_gym_scorer(name[3:])
    from posttrain.data.tasks import get_task

    scorer = get_task(name)

    def score(completion: str, answer: Any, prompt: str, row: dict) -> float:
        return scorer.score(completion, str(answer), **row)

    return score


def _reasoning_gym_scorer(dataset: str) -> Callable[[str, Any, str, dict], float]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(
            f"task 'rg:{dataset}' needs reasoning-gym: pip install 'posttrain[tasks]'"
        ) from None
    if hasattr(reasoning_gym, "get_score_answer_fn"):
        score_answer = reasoning_gym.get_score_answer_fn(dataset)
    else:
        score_answer = reasoning_gym.create_dataset(dataset, size=1, seed=0).score_answer

    def score(completion: str, answer: Any, prompt: str, row: dict) -> float:
        metadata = row.get("metadata") or {}
        if isinstance(metadata, str):
            metadata = json.loads(metadata)
        entry = {"question": row.get("question") or prompt, "answer": answer, "metadata": metadata}
        return float(score_answer(answer=extract_final_answer(completion), entry=entry))

    return score


_FENCE = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last ```python block, else the last ``` block of any language, else the whole text."""
    blocks = _FENCE.findall(text)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else text


def code_tests(
    completions: Sequence[Any],
    tests: Sequence[Any],
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    **kwargs: Any,
) -> list[float | None | Exception]:
    """Fraction of the row's tests that the completion's code passes, run in the sandbox.

    The code is `extract_code(completion)`; `tests` holds, per row, a list of tests (assert
    statements) or one string of them. Code and tests run in one sandboxed process per
    completion (`posttrain.rewards.sandbox.run_python_tests`: separate process, resource
    limits, no network, killed with its process group after `timeout_s`), so an infinite loop
    scores 0.0 after `timeout_s`. Completions run in parallel, one sandbox per CPU; set the
    runner's `timeout_s` to cover ceil(B / CPUs) · `timeout_s`. A row without tests (None or
    empty) gives None; a row whose tests are not valid Python fails alone (the runner's
    failure reward), as does a host where the sandbox cannot start (`SandboxError`).
    """
    from posttrain.rewards.base import map_in_daemon_threads
    from posttrain.rewards.sandbox import run_python_tests

    def one(i: int) -> float | None:
        if not tests[i]:
            return None
        code = extract_code(completion_text(completions[i]))
        row_tests = tests[i] if isinstance(tests[i], str) else list(tests[i])
        return run_python_tests(code, row_tests, timeout_s=timeout_s, memory_mb=memory_mb).fraction

    values, errors, _ = map_in_daemon_threads(one, range(len(completions)), _cpu_count())
    return [v if e is None else e for v, e in zip(values, errors)]


code_tests.is_correctness = True


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "math_accuracy": math_accuracy,
    "exact_match": exact_match,
    "env_reward": env_reward,
    "format_reward": format_reward,
    "overlong_penalty": overlong_penalty,
    "task_reward": task_reward,
    "code_tests": code_tests,
    "llm_judge": llm_judge,
    "reward_model": reward_model,
}
# Entries that build the reward function from options rather than being one.
REWARD_FACTORIES = frozenset({"format_reward", "overlong_penalty", "task_reward", "llm_judge", "reward_model"})
