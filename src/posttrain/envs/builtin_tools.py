"""Built-in tools: `calculator` (arithmetic read by `ast`, never `eval`) and `python` (the sandbox).

    calculator("23*47 + 5")        -> "1086"
    python("print(sum(range(10)))") -> "45"

Both take one string, so in the plain-text protocol the call is the text itself:
`<call>calculator(23*47)</call>`.
"""

from __future__ import annotations

import ast
import math
import operator

from posttrain.envs.tools import parse_model_text
from posttrain.rewards.sandbox import run_python

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100
"""Largest exponent `**` accepts, and MAX_DIGITS the largest result: `9**9**9` must not
take the machine."""
MAX_DIGITS = 100
MAX_EXPRESSION_CHARS = 500


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "23*47 + 5".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    value = _evaluate(parse_model_text(expression.strip()).body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        return str(int(value)) if value.is_integer() else repr(round(value, 10))
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def python_tool(timeout_s: float = 5.0, memory_mb: int = 512):
    """The `python` tool with its sandbox limits (wall-clock seconds, address space in MiB)."""

    def python(code: str) -> str:
        """Run Python code in the sandbox and return what it prints.

        Args:
            code: A Python program (standard library only); its standard output is the result.
        """
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)
        if result.ok:
            return result.stdout.rstrip("\n")
        why = result.error or f"exit status {result.returncode}"
        tail = result.stderr.strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"{why}: {tail[0]}".rstrip(": "))

    return python


python = python_tool()
"""Python in the sandbox, 5 s and 512 MiB per call."""

BUILTIN_TOOLS = {"calculator": calculator, "python": python}
"""The built-in tools by name (what `rollout.tools` may name besides `module:function`)."""
