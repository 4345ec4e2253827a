"""Countdown: combine the given numbers with `+ - * /` to reach a target.

    prompt      "Use 3 7 25 to make 96:"
    completion  "25+7=32\\n32*3=96\\nAnswer: (25+7)*3"
    answer      "96"            numbers  [3, 7, 25]

Rules the scorer enforces on the expression after `Answer:`:
  - only integer literals, `+ - * /` and parentheses (no unary minus, no `**`, no `//`);
  - every literal is one of the given numbers, each used at most as often as it is given
    (using only some of them is fine);
  - division must be exact: every `/` must give an integer (`(7/2)*4` is wrong);
    intermediate results may be zero or negative;
  - the value equals the target.
The expression is parsed with `ast` and evaluated over `fractions.Fraction`: nothing the
model writes is ever executed.

Instances are built backwards so that each has a solution: the generator repeatedly
combines two of the remaining values (larger first) until one is left, keeping every
intermediate a positive integer no larger than `max_target` and never multiplying or
dividing by 1, so the built solution uses all the numbers and each step does something.
Targets equal to one of the given numbers are skipped, since they need no arithmetic.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from posttrain.data.tasks.base import (
    Task,
    extract_answer,
    format_completion,
    int_range,
    resolve_options,
)

# Whitelisting characters before `ast` rules out names, calls, attributes, strings, floats,
# `0x19`, `2_5` and the like, and the length cap bounds parser recursion.
_EXPRESSION = re.compile(r"[0-9+\-*/() ]{1,100}")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3
_AST_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
# The generator only divides exactly, so floor division is exact division there.
_INT_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


class CountdownTask(Task):
    """Reach a target from a few numbers, e.g. `Use 3 7 25 to make 96:` → `(25+7)*3`.

    Args (None takes the value from the `difficulty` preset):
        difficulty: "easy" | "medium" (default) | "hard"; see `presets`.
        num_numbers: how many numbers are given, an int or an inclusive (min, max) range
            within 2..5.
        max_number: the numbers are drawn uniformly from 1..max_number (repeats allowed).
        max_target: the bound on the target and on every intermediate of the built solution.
    """

    name = "countdown"
    presets = {
        "easy": {"num_numbers": 3, "max_number": 20, "max_target": 100},
        "medium": {"num_numbers": (3, 4), "max_number": 25, "max_target": 250},
        "hard": {"num_numbers": 4, "max_number": 100, "max_target": 999},
    }
    grow_hint = "raise `max_number`, `max_target` or `num_numbers`, or pick a harder `difficulty`"

    def __init__(
        self,
        *,
        difficulty: str = "medium",
        num_numbers: int | tuple[int, int] | None = None,
        max_number: int | None = None,
        max_target: int | None = None,
    ) -> None:
        options = resolve_options(
            self.presets,
            difficulty,
            num_numbers=num_numbers,
            max_number=max_number,
            max_target=max_target,
        )
        super().__init__(options)
        self.num_numbers = int_range(options["num_numbers"], "num_numbers", 2, 5)
        for key in ("max_number", "max_target"):
            if not (isinstance(options[key], int) and options[key] >= 2):
                raise ValueError(f"{key} must be an int >= 2, got {options[key]!r}")
        self.max_number, self.max_target = options["max_number"], options["max_target"]

    def generate(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        return [self._row(rng) for _ in range(n)]

    def _row(self, rng: random.Random) -> dict[str, Any]:
        for _ in range(1000):
            numbers = sorted(
                rng.randint(1, self.max_number) for _ in range(rng.randint(*self.num_numbers))
            )
            target, expr, steps = self._build(numbers, rng)
            if target not in numbers:
                prompt = f"Use {' '.join(map(str, numbers))} to make {target}:"
                completion = format_completion(steps, expr)
                return {
                    "prompt": prompt,
                    "answer": str(target),
                    "completion": completion,
                    "numbers": numbers,
                }
        raise ValueError(
            f"countdown could not build a target unlike its numbers with {self.options}; {self.grow_hint}"
        )

    def _build(self, numbers: list[int], rng: random.Random) -> tuple[int, str, list[str]]:
        """Combine random pairs until one value is left: its value, expression and steps."""
        pool = [(x, str(x), _ATOM) for x in numbers]  # (value, expression, precedence)
        steps = []
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (a, ea, pa), (b, eb, pb) = sorted([pool[i], pool[j]], key=lambda item: -item[0])
            op = rng.choice(self._legal_ops(a, b))
            value = _INT_OPS[op](a, b)
            steps.append(f"{a}{op}{b}={value}")
            pool = [item for k, item in enumerate(pool) if k not in (i, j)]
            pool.append((value, _join(ea, pa, op, eb, pb), _PRECEDENCE[op]))
        return pool[0][0], pool[0][1], steps

    def _legal_ops(self, a: int, b: int) -> list[str]:
        """Ops on a >= b >= 1 that keep the result a positive integer <= max_target.

        `*1` and `/1` are left out: they spend a number and a step without changing the value.
        Never empty: `a-b` is legal when a > b, `a/b` when a == b > 1, `1+1` as max_target >= 2.
        """
        ops = ["+"] if a + b <= self.max_target else []
        if a > b:
            ops.append("-")
        if b > 1 and a * b <= self.max_target:
            ops.append("*")
        if b > 1 and a % b == 0:
            ops.append("/")
        return ops

    def score(
        self, completion: str, answer: str, /, *, numbers: list[int] | None = None, **row: Any
    ) -> float:
        if numbers is None:
            raise ValueError(
                "countdown needs the row's `numbers` column to score: score(..., numbers=[...])"
            )
        expr = extract_answer(completion)
        value = None if expr is None else evaluate_expression(expr, numbers)
        return float(value is not None and value == int(answer))


def _join(left: str, lp: int, op: str, right: str, rp: int) -> str:
    """`left op right` with only the parentheses precedence and left-associativity need."""
    prec = _PRECEDENCE[op]
    if lp < prec:
        left = f"({left})"
    if rp < prec or (rp == prec and op in "-/"):
        right = f"({right})"
    return f"{left}{op}{right}"


class _Invalid(Exception):
    """The expression breaks a rule; it scores 0."""


def evaluate_expression(expr: str, numbers: list[int]) -> int | None:
    """The value of a countdown answer under the rules in the module docstring, or None."""
    if not _EXPRESSION.fullmatch(expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        literals: list[int] = []
        value = _evaluate(tree.body, literals)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _Invalid):
        return None
    if Counter(literals) - Counter(numbers):  # a literal not given, or used too often
        return None
    return int(value)


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if not (isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS):
        raise _Invalid(type(node).__name__)
    a, b = _evaluate(node.left, literals), _evaluate(node.right, literals)
    if isinstance(node.op, ast.Div) and (b == 0 or (a / b).denominator != 1):
        raise _Invalid("division by zero or with a remainder")
    return _AST_OPS[type(node.op)](a, b)
