"""Arithmetic: integer expressions over `+ - *` with the usual precedence.

    prompt      "37+85*2="
    completion  "85*2=170\\n37+170=207\\nAnswer: 207"
    answer      "207"

The worked solution has one line per binary operation, in the order precedence dictates:
products left to right, then sums and differences left to right. With two operands that
single line would only repeat the prompt, so the completion is just the answer line.
`worked` < 1 makes the demonstrations mixed: that fraction of the completions show the
steps, the others only the answer line (a demonstrator that sometimes skips its work).
Operands are non-negative; answers can be negative.

`hinted` > 0 adds a way to ask for the steps: that fraction of the *training* rows open with
`HINT` ("Show work: 37+85*2=") and always show the steps, while held-out and RL prompts never
carry it (`make_task` passes only the train split through `Task.prepare_train`). A model
fine-tuned this way can work step by step when asked, but mostly answers an unhinted
prompt from its head (as often as `worked` says); RL on unhinted prompts then has a skill
to draw out, the way RL on an instruction-tuned model draws out reasoning it seldom uses.

The scorer accepts any integer-valued spelling of the answer (`207`, `+207`, `207.0`) and
nothing else (`207a`, `207 or 208`, `2.07e2`).
"""

from __future__ import annotations

import random
import re
from typing import Any

from posttrain.data.tasks.base import (
    Task,
    extract_answer,
    format_completion,
    int_range,
    resolve_options,
)

_INTEGER = re.compile(r"[+-]?[0-9]+(?:\.0*)?")
_TERM = re.compile(r"([+*-]?)([0-9]+)")
HINT = "Show work: "


class ArithmeticTask(Task):
    """Expressions like `37+85*2=`; the answer is their integer value.

    Args (None takes the value from the `difficulty` preset):
        difficulty: "easy" | "medium" (default) | "hard" | "harder"; see `presets`.
        digits: the most digits an operand has; operands are uniform in [0, 10**digits).
        mul_digits: the most digits of an operand next to a `*` (capped at `digits`), so
            products can stay learnable while sums use bigger numbers.
        operators: the operators drawn from, a non-empty subset of "+-*".
        num_operands: operands per expression, an int or an inclusive (min, max) range
            within 2..4.
        worked: the fraction of completions (of 3+ operands) that show the worked steps;
            the rest are the answer line alone. Scoring reads only the answer, so a model
            may answer either way: RL can learn which way pays.
        hinted: the fraction of training rows (3+ operands) whose prompt opens with `HINT`
            and whose completion shows the steps; `worked` applies to the other rows.
            Held-out and RL prompts are never hinted. Not part of the presets (default 0).
    """

    name = "arithmetic"
    # `medium` is calibrated on the built-in tiny model (benchmarks/README.md, "SFT learning"
    # and "Demo robustness"): after 1000 SFT steps (recipes/sft_arithmetic.yaml) it shows its
    # steps on ~80% of held-out problems right but answers ~20% right from its head, and
    # greedy decoding takes either way on about half the prompts, so held-out accuracy lands
    # near 40-60% with room for RL to learn that the worked way pays. With 3 operands the
    # same model learns to answer 84% right from its head (no room left). Its prompts all
    # have 4 operands (270,000 distinct prompts, far more than `make_task`'s 8,000 + 500):
    # 1-digit sums of 2 have only 300 distinct prompts, which the test split (drawn first)
    # would mostly take (a test set unlike the training set).
    presets = {
        "easy": {"digits": 1, "mul_digits": 1, "operators": "+-", "num_operands": (2, 3), "worked": 1.0},
        "medium": {"digits": 1, "mul_digits": 1, "operators": "+-*", "num_operands": 4, "worked": 0.5},
        "hard": {"digits": 2, "mul_digits": 1, "operators": "+-*", "num_operands": 3, "worked": 1.0},
        "harder": {"digits": 3, "mul_digits": 2, "operators": "+-*", "num_operands": (3, 4), "worked": 1.0},
    }
    grow_hint = "raise `digits`, `mul_digits` or `num_operands`, add `operators`, or pick a harder `difficulty`"

    def __init__(
        self,
        *,
        difficulty: str = "medium",
        digits: int | None = None,
        mul_digits: int | None = None,
        operators: str | None = None,
        num_operands: int | tuple[int, int] | None = None,
        worked: float | None = None,
        hinted: float = 0.0,
    ) -> None:
        options = resolve_options(
            self.presets,
            difficulty,
            digits=digits,
            mul_digits=mul_digits,
            operators=operators,
            num_operands=num_operands,
            worked=worked,
        )
        super().__init__(options)
        for key in ("digits", "mul_digits"):
            if not (isinstance(options[key], int) and options[key] >= 1):
                raise ValueError(f"{key} must be an int >= 1, got {options[key]!r}")
        self.digits = options["digits"]
        self.mul_digits = min(options["mul_digits"], self.digits)
        ops = options["operators"]
        if not (isinstance(ops, str) and ops and set(ops) <= set("+-*")):
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {ops!r}")
        self.operators = self.options["operators"] = "".join(sorted(set(ops), key="+-*".index))
        self.num_operands = int_range(options["num_operands"], "num_operands", 2, 4)
        self.worked = _fraction(options["worked"], "worked")
        self.hinted = _fraction(hinted, "hinted")
        if self.hinted:  # recorded only when used, so task.json of unhinted data keeps its bytes
            self.options["hinted"] = self.hinted

    def generate(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        return [self._row(*self._sample(rng), rng) for _ in range(n)]

    def _sample(self, rng: random.Random) -> tuple[list[int], list[str]]:
        k = rng.randint(*self.num_operands)
        ops = [rng.choice(self.operators) for _ in range(k - 1)]
        nums = []
        for i in range(k):
            is_factor = (i > 0 and ops[i - 1] == "*") or (i < k - 1 and ops[i] == "*")
            nums.append(rng.randrange(10 ** (self.mul_digits if is_factor else self.digits)))
        return nums, ops

    def _row(self, nums: list[int], ops: list[str], rng: random.Random) -> dict[str, Any]:
        prompt = str(nums[0]) + "".join(f"{op}{x}" for op, x in zip(ops, nums[1:])) + "="
        value, steps = solve(nums, ops)
        # A draw only when the demonstrations are mixed, so worked=1 keeps the same problems.
        show = len(nums) >= 3 and (self.worked >= 1 or (self.worked > 0 and rng.random() < self.worked))
        shown = steps if show else []
        return {
            "prompt": prompt,
            "answer": str(value),
            "completion": format_completion(shown, value),
        }

    def prepare_train(self, rows: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
        """Hint a `hinted` fraction of the training rows of 3+ operands: `HINT` + prompt,
        completion with the steps. No draws when `hinted` is 0 (the same rows as before)."""
        if not self.hinted:
            return rows
        for row in rows:
            nums, ops = parse_prompt(row["prompt"])
            if len(nums) >= 3 and rng.random() < self.hinted:
                value, steps = solve(nums, ops)
                row["prompt"], row["completion"] = HINT + row["prompt"], format_completion(steps, value)
        return rows

    def score(self, completion: str, answer: str, /, **row: Any) -> float:
        value = parse_integer(extract_answer(completion))
        return float(value is not None and value == int(answer))


def solve(nums: list[int], ops: list[str]) -> tuple[int, list[str]]:
    """Evaluate `nums[0] ops[0] nums[1] ...` by precedence; return the value and step lines."""
    steps, terms, signs = [], [nums[0]], []
    for op, x in zip(ops, nums[1:]):
        if op == "*":
            steps.append(f"{terms[-1]}*{x}={terms[-1] * x}")
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(op)
    acc = terms[0]
    for op, x in zip(signs, terms[1:]):
        new = acc + x if op == "+" else acc - x
        steps.append(f"{acc}{op}{x}={new}")
        acc = new
    return acc, steps


def parse_prompt(prompt: str) -> tuple[list[int], list[str]]:
    """`"37+85*2="` -> ([37, 85, 2], ["+", "*"]): the inverse of the prompt `_row` writes."""
    terms = _TERM.findall(prompt.removeprefix(HINT).removesuffix("="))
    return [int(x) for _, x in terms], [op for op, _ in terms[1:]]


def _fraction(value: Any, key: str) -> float:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise ValueError(f"{key} must be a number in [0, 1], got {value!r}")
    return value


def parse_integer(value: str | None) -> int | None:
    """`value` as an int if it spells one (`-5`, `+5`, `5.0`), else None."""
    # The length cap keeps clear of int()'s 4300-digit limit, which would raise.
    if value is None or len(value) > 1000 or not _INTEGER.fullmatch(value):
        return None
    return int(value.split(".")[0])
