"""The plain-text tool-call protocol for the built-in byte tokenizer (and any model without a
chat template for tools).

    model:        Let me compute. <call>calculator(23*47)</call>
    environment:  <result>1081</result>
    model:        <call>calculator(1081+5)</call>
    environment:  <result>1086</result>
    model:        The answer is 1086.<|eos|>

Rules, chosen so a tiny byte-level model can learn them from a few hundred demonstrations:
- A call is `<call>NAME(ARGS)</call>`: NAME a Python identifier, ARGS everything between
  the first `(` and the `)` that ends the call. A tool with one parameter gets ARGS as
  its raw text, so code and expressions need no quoting; other tools read ARGS as
  Python literal call arguments (`tools.bind_arguments`).
- `</call>` (CALL_END) is the model turn's stop string: the turn ends on the call, the
  environment runs it and answers with one `<result>…</result>` per call, in order. A
  failed call answers `<result>error: …</result>`.
- A turn without a call is the model's final answer: the episode ends.
- Text inside `<call>` that does not read as `NAME(ARGS)` is a malformed call: it is
  answered with an error result (and counted), never dropped silently.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.envs.tools import ToolCall

CALL_START, CALL_END = "<call>", "</call>"
RESULT_START, RESULT_END = "<result>", "</result>"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_SIGNATURE = re.compile(r"\s*([A-Za-z_]\w*)\((.*)\)\s*", re.DOTALL)


@dataclass(frozen=True)
class MalformedCall:
    """A call that does not read (a `<call>` whose inside is not `NAME(ARGS)`, a chat tool
    call that is not JSON): answered with an error result."""

    text: str
    hint: str = f"write {CALL_START}name(arguments){CALL_END}"

    @property
    def message(self) -> str:
        return f"error: malformed call {self.text!r}; {self.hint}"


def parse_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<call>…</call>` in `text`, in order."""
    out: list[ToolCall | MalformedCall] = []
    for body in _CALL.findall(text):
        match = _SIGNATURE.fullmatch(body)
        out.append(ToolCall(match.group(1), match.group(2)) if match else MalformedCall(body))
    return out


def format_call(name: str, arguments: str) -> str:
    """`<call>name(arguments)</call>` (SFT demonstrations write calls with it)."""
    return f"{CALL_START}{name}({arguments}){CALL_END}"


def format_results(results: Sequence[str]) -> str:
    """The environment's answer: `<result>r</result>` for each result, in order."""
    return "".join(f"{RESULT_START}{r}{RESULT_END}" for r in results)


def describe_tools(schemas: Sequence[dict]) -> str:
    """One line per tool, for a prompt: `Tools: calculator(expression): Evaluate …`."""
    lines = []
    for schema in schemas:
        fn = schema["function"]
        params = ", ".join(fn["parameters"].get("properties", {}))
        lines.append(f"{fn['name']}({params}): {fn.get('description', '')}".rstrip(": "))
    return "Tools: " + "; ".join(lines) + f". Call one as {CALL_START}name(arguments){CALL_END}."


class TextProtocol:
    """The protocol above as an object (what `ToolEnvironment` talks through)."""

    stop = (CALL_END,)
    """Stop strings of a model turn: it ends on the call."""

    def parse_calls(self, text: str) -> list[ToolCall | MalformedCall]:
        return parse_calls(text)

    def format_results(self, results: Sequence[tuple[str, str]]) -> str:
        """(tool name, result text) per call -> the observation."""
        return format_results([text for _, text in results])

    def describe(self, schemas: Sequence[dict]) -> str | None:
        """Text appended to the prompt at reset: the tools and how to call them."""
        return " " + describe_tools(schemas) if schemas else None
