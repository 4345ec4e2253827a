"""Arithmetic with a calculator: sums of products too big to do in the head of a tiny model.

    prompt      "23*47+58*91="
    completion  "<call>calculator(23*47)</call><result>1081</result>"
                "<call>calculator(58*91)</call><result>5278</result>"
                "<call>calculator(1081+5278)</call><result>6359</result>\\nAnswer: 6359"
    answer      "6359"

The demonstration is a multi-turn episode in the plain-text tool protocol
(`posttrain.envs.text_protocol`): one calculator call per product, then one call for the
sum of their results, then the answer line. Each model turn ends on `</call>`; the
`<result>…</result>` spans are what the environment (`posttrain.envs.ArithmeticTools`)
answers, so SFT does not train on them (`data.environment_markers`) and an RL episode
appends them itself. `use_tools=False` writes the same problems with the answer line
alone (a no-tool baseline). The scorer is arithmetic's: the integer on the last
`Answer:` line (results above it are never read).
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.data.tasks.arithmetic import parse_integer
from posttrain.data.tasks.base import (
    Task,
    extract_answer,
    format_completion,
    int_range,
    resolve_options,
)

CALL = "<call>calculator({})</call><result>{}</result>"
"""One calculator call and its result, as the text protocol writes them."""


class ArithmeticToolsTask(Task):
    """Sums of products like `23*47+58*91=`; the answer is their value.

    Args (None takes the value from the `difficulty` preset):
        difficulty: "easy" | "medium" (default) | "hard"; see `presets`.
        terms: products per problem, an int or an inclusive (min, max) range within 2..4.
        digits: digits of each factor, an int or an inclusive range within 1..4 (drawn per
            factor; a k-digit factor is uniform in [10**(k-1), 10**k)).
        use_tools: completions call the calculator (True) or give the answer line only.
    """

    name = "arithmetic_tools"
    presets = {
        "easy": {"terms": 2, "digits": 2, "use_tools": True},
        "medium": {"terms": 2, "digits": (2, 3), "use_tools": True},
        "hard": {"terms": 3, "digits": 3, "use_tools": True},
    }
    grow_hint = "raise `terms` or `digits`, or pick a harder `difficulty`"

    def __init__(
        self,
        *,
        difficulty: str = "medium",
        terms: int | tuple[int, int] | None = None,
        digits: int | tuple[int, int] | None = None,
        use_tools: bool | None = None,
    ) -> None:
        options = resolve_options(self.presets, difficulty, terms=terms, digits=digits, use_tools=use_tools)
        super().__init__(options)
        self.terms = int_range(options["terms"], "terms", 2, 4)
        self.digits = int_range(options["digits"], "digits", 1, 4)
        if not isinstance(options["use_tools"], bool):
            raise ValueError(f"use_tools must be true or false, got {options['use_tools']!r}")
        self.use_tools = options["use_tools"]

    def generate(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        return [self._row(rng) for _ in range(n)]

    def _factor(self, rng: random.Random) -> int:
        k = rng.randint(*self.digits)
        return rng.randrange(10 ** (k - 1), 10**k)

    def _row(self, rng: random.Random) -> dict[str, Any]:
        pairs = [(self._factor(rng), self._factor(rng)) for _ in range(rng.randint(*self.terms))]
        products = [a * b for a, b in pairs]
        value = sum(products)
        prompt = "+".join(f"{a}*{b}" for a, b in pairs) + "="
        return {"prompt": prompt, "answer": str(value), "completion": self.demonstration(pairs)}

    def demonstration(self, pairs: list[tuple[int, int]]) -> str:
        """The completion for the products `pairs` (module docstring)."""
        products = [a * b for a, b in pairs]
        answer = format_completion([], sum(products))
        if not self.use_tools:
            return answer
        calls = [CALL.format(f"{a}*{b}", a * b) for a, b in pairs]
        calls.append(CALL.format("+".join(map(str, products)), sum(products)))
        return "".join(calls) + "\n" + answer

    def score(self, completion: str, answer: str, /, **row: Any) -> float:
        value = parse_integer(extract_answer(completion))
        return float(value is not None and value == int(answer))
