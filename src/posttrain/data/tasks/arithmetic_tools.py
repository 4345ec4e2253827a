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
alone (a no-tool baseline); `tool_fraction` < 1 calls the calculator in only that fraction
of the demonstrations (the rest answer from the head), a model that knows its tool but
seldom reaches for it, which RL can teach to use it. Which problems call it is a function
of the prompt alone, so every `tool_fraction` writes the same problems. `hinted` > 0 opens
that fraction of the *training* prompts with `HINT` ("Use the calculator: 23*47+58*91=")
and makes them call it; held-out and RL prompts are never hinted (`Task.prepare_train`).
`sum_call_fraction` < 1 keeps the calls for the products in every tool demonstration but
calls the calculator for their sum in only that fraction; the others write the answer
after the products' results (`...<result>5278</result>\nAnswer: 6359`), adding in the head,
which the tiny model mostly gets wrong. Every demonstration copies operands into calls, and
RL has a choice to learn: hand the sum to the tool too. `product_call_fraction` < 1 makes
the choice at the first product instead: the others work it out in the head
(`23*47=1081\n<call>calculator(58*91)</call>...`) and call the calculator for the rest,
sum included, so that every demonstration copies both operands and results into calls,
and RL has to learn to hand the first product to the tool too. The scorer is
arithmetic's: the integer on the last `Answer:` line (results above it are never read).
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from posttrain.data.tasks.arithmetic import _fraction, parse_integer
from posttrain.data.tasks.base import (
    Task,
    extract_answer,
    format_completion,
    int_range,
    resolve_options,
)

HINT = "Use the calculator: "
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
        tool_fraction: with use_tools, the fraction of completions that call it (default
            1); the others give the answer line only. Not part of the presets.
        hinted: with use_tools, the fraction of training rows whose prompt opens with `HINT`
            and whose completion calls the calculator; `tool_fraction` applies to the
            others. Held-out and RL prompts are never hinted. Not part of the presets.
        sum_call_fraction: with use_tools, the fraction of tool demonstrations that call the
            calculator for the sum of the products too (default 1); the others write the
            answer after the products' results. Hinted rows always call it. Not part of
            the presets.
        product_call_fraction: with use_tools, the fraction of tool demonstrations that call
            the calculator for the first product (default 1); the others write it out in
            the head (`23*47=1081` and a newline) before the other calls. Hinted rows always
            call it. Not part of the presets.
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
        tool_fraction: float = 1.0,
        hinted: float = 0.0,
        sum_call_fraction: float = 1.0,
        product_call_fraction: float = 1.0,
    ) -> None:
        options = resolve_options(self.presets, difficulty, terms=terms, digits=digits, use_tools=use_tools)
        super().__init__(options)
        self.terms = int_range(options["terms"], "terms", 2, 4)
        self.digits = int_range(options["digits"], "digits", 1, 4)
        if not isinstance(options["use_tools"], bool):
            raise ValueError(f"use_tools must be true or false, got {options['use_tools']!r}")
        self.use_tools = options["use_tools"]
        self.tool_fraction, self.hinted = _fraction(tool_fraction, "tool_fraction"), _fraction(hinted, "hinted")
        self.sum_call_fraction = _fraction(sum_call_fraction, "sum_call_fraction")
        self.product_call_fraction = _fraction(product_call_fraction, "product_call_fraction")
        # Recorded only when used, so that task.json of other data keeps its bytes.
        if tool_fraction < 1:
            self.options["tool_fraction"] = tool_fraction
        if hinted:
            self.options["hinted"] = hinted
        if sum_call_fraction < 1:
            self.options["sum_call_fraction"] = sum_call_fraction
        if product_call_fraction < 1:
            self.options["product_call_fraction"] = product_call_fraction

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
        return {"prompt": prompt, "answer": str(value),
                "completion": self.demonstration(pairs, self.use_tools and _calls(prompt, self.tool_fraction),
                                                 _calls("sum:" + prompt, self.sum_call_fraction),
                                                 _calls("product:" + prompt, self.product_call_fraction))}

    def demonstration(self, pairs: list[tuple[int, int]], use_tools: bool | None = None,
                      sum_call: bool = True, product_call: bool = True) -> str:
        """The completion for the products `pairs` (module docstring); `use_tools` None = the
        task's; `sum_call` False: no call for the sum of the products (added in the head);
        `product_call` False: no call for the first product (`23*47=1081\n`, in the head)."""
        products = [a * b for a, b in pairs]
        answer = format_completion([], sum(products))
        if not (self.use_tools if use_tools is None else use_tools):
            return answer
        calls = [CALL.format(f"{a}*{b}", a * b) for a, b in pairs]
        if not product_call:
            a, b = pairs[0]
            calls[0] = f"{a}*{b}={a * b}\n"
        if sum_call:
            calls.append(CALL.format("+".join(map(str, products)), sum(products)))
        return "".join(calls) + "\n" + answer

    def prepare_train(self, rows: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
        """Hint a `hinted` fraction of the training rows: `HINT` + prompt, a completion that
        calls the calculator. No draws when `hinted` is 0 (the same rows as before)."""
        if not (self.hinted and self.use_tools):
            return rows
        for row in rows:
            if rng.random() < self.hinted:
                pairs = pairs_of(row["prompt"])
                row["prompt"], row["completion"] = HINT + row["prompt"], self.demonstration(pairs, use_tools=True)
        return rows

    def score(self, completion: str, answer: str, /, **row: Any) -> float:
        value = parse_integer(extract_answer(completion))
        return float(value is not None and value == int(answer))


def pairs_of(prompt: str) -> list[tuple[int, int]]:
    """The factors of a prompt, `23*47+58*91=` -> [(23, 47), (58, 91)] (a hint before it is
    dropped)."""
    terms = prompt.removeprefix(HINT).removesuffix("=").split("+")
    return [(int(a), int(b)) for a, b in (term.split("*") for term in terms)]


def _calls(key: str, fraction: float) -> bool:
    """Whether the demonstration keyed by `key` (the prompt; "sum:" + prompt for the sum's
    call) calls the calculator: a uniform draw from the key's CRC-32, so that it does not
    move the task's random stream."""
    return fraction >= 1 or zlib.crc32(key.encode()) / 2**32 < fraction
