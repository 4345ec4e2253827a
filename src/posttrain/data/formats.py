"""Dataset formats (as TRL), their detection, and row validation.

A format is named by its columns; each text column holds either a string ("standard")
or a list of `{"role", "content"}` messages ("conversational"), as in TRL:

| format                | columns                     | used by                  |
|-----------------------|-----------------------------|--------------------------|
| `text`                | text                        | SFT (language modeling)  |
| `prompt_completion`   | prompt, completion          | SFT                      |
| `messages`            | messages (always messages)  | SFT                      |
| `preference`          | prompt, chosen, rejected    | DPO, reward modeling     |
| `implicit_preference` | chosen, rejected            | DPO, reward modeling     |
| `prompt`              | prompt (+ any extra column) | online RL                |

Extra columns are kept in every format (RL reward functions receive them as keyword
arguments). ShareGPT rows (`{"conversations": [{"from": "human", "value": ...}, ...]}`) are
read as `messages` (`chatml_row`, TRL's `maybe_convert_to_chatml`). Validation checks every row, never just the first, and names the row's
source and line, the column, what was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
    "implicit_preference": ("chosen", "rejected"),
    "prompt": ("prompt",),
}
"""Required columns of each format, in the order they are reported in errors."""

# Auto-detection tries these in order: the first whose columns are all present wins, so a
# dataset with prompt, completion and chosen/rejected is preference data, not SFT data.
_DETECTION_ORDER = (
    "messages",
    "preference",
    "implicit_preference",
    "prompt_completion",
    "text",
    "prompt",
)
_CHAT_ONLY_COLUMNS = {"messages"}
_TEXT_ONLY_COLUMNS = {"text"}


class DataFormatError(ValueError):
    """A dataset does not match its format; the message names the source, row and column."""


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function": "tool", "observation": "tool"}
"""ShareGPT's `from` → the chat `role` (observation and function are tool results)."""
_MESSAGE_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected")


def chatml_row(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """A ShareGPT row in chat-message form, as TRL's `maybe_convert_to_chatml`: the column
    `conversations` becomes `messages`, and in it (and in any format column holding messages)
    each {"from", "value"} becomes {"role": SHAREGPT_ROLES[from], "content": value}, other keys
    kept. Any other row is returned as it is. Raises DataFormatError for an unknown `from`."""
    if "conversations" not in row and not any(_is_sharegpt(row.get(c)) for c in _MESSAGE_COLUMNS):
        return row
    out = dict(row)
    if "conversations" in out:
        if "messages" in out:
            raise DataFormatError("has both `conversations` (ShareGPT) and `messages`; keep one")
        out["messages"] = out.pop("conversations")
    for col in _MESSAGE_COLUMNS:
        if _is_sharegpt(out.get(col)):
            out[col] = [_chatml_message(m, col, j) for j, m in enumerate(out[col])]
    return out


def _is_sharegpt(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(m, Mapping) and "from" in m for m in value)


def _chatml_message(message: Any, col: str, j: int) -> Any:
    if not isinstance(message, Mapping) or "from" not in message:
        return message  # validate_rows names what is wrong with it
    role = SHAREGPT_ROLES.get(message["from"])
    if role is None:
        raise DataFormatError(f"column {col!r}: message {j} is from {message['from']!r}, not a ShareGPT role; "
                              f"expected one of {', '.join(SHAREGPT_ROLES)}")
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    return {"role": role, "content": message.get("value"), **rest}


def detect_format(columns: Iterable[str], first_row: Mapping[str, Any] | None = None, source: str | None = None) -> str:
    """Name the format of a dataset from its column names (see the table in the module doc).

    `first_row` and `source` (the file the columns are from) only enrich the error when no
    format matches (it names the file, and shows the row's keys and value types); the format
    itself depends on the columns alone.
    """
    present = set(columns)
    for fmt in _DETECTION_ORDER:
        if all(col in present for col in FORMAT_COLUMNS[fmt]):
            return fmt
    expected = "; ".join(f"{fmt}: {', '.join(cols)}" for fmt, cols in FORMAT_COLUMNS.items())
    found = ", ".join(sorted(present)) or "no columns"
    msg = f"cannot tell the dataset format from its columns; expected one of [{expected}]; found {found}"
    if source is not None:
        msg = f"{source}: {msg}"
    if first_row is not None:
        types = ", ".join(f"{k}: {type(v).__name__}" for k, v in first_row.items())
        msg += f" (first row: {{{types}}})"
    raise DataFormatError(msg)


def is_conversational(row: Mapping[str, Any], fmt: str | None = None) -> bool:
    """True when the row's format columns hold message lists rather than strings (TRL's test).

    With `fmt`, only that format's columns are looked at (an extra column never decides).
    """
    if fmt in _TEXT_ONLY_COLUMNS:
        return False
    for col in FORMAT_COLUMNS.get(fmt, ("messages", "prompt", "completion", "chosen", "rejected")):
        if col in row:
            value = row[col]
            return isinstance(value, list) and (len(value) == 0 or isinstance(value[0], Mapping))
    return False


def _describe(value: Any) -> str:
    if isinstance(value, list):
        inner = type(value[0]).__name__ if value else "nothing"
        return f"a list of {inner} (length {len(value)})"
    return type(value).__name__


def _message_problem(value: Any) -> str | None:
    """Why `value` is not a list of {role: str, content: str} messages, or None if it is."""
    if not isinstance(value, list):
        return f"{_describe(value)}"
    if not value:
        return "an empty list"
    for j, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            return f"message {j} is a {type(msg).__name__}, not an object"
        if not isinstance(msg.get("role"), str):
            return f"message {j} has no string 'role' (keys: {', '.join(map(str, msg))})"
        content = msg.get("content")
        # A tool-calling assistant turn may carry its payload in tool_calls, with no content.
        if not isinstance(content, str) and not (content is None and msg.get("tool_calls")):
            return f"message {j} has content of type {type(content).__name__}, expected str"
    return None


def _value_problem(value: Any, conversational: bool) -> tuple[str, str] | None:
    """(expected, found) when `value` is not of the required kind, else None."""
    if conversational:
        problem = _message_problem(value)
        return None if problem is None else ("a list of {role, content} messages", problem)
    if isinstance(value, str):
        return None
    return ("a string", _describe(value))


def _default_locate(source_name: str) -> Callable[[int], str]:
    return lambda i: f"{source_name}: row {i + 1}"


def validate_rows(
    rows: Sequence[Mapping[str, Any]], fmt: str, source_name: str | None = None
) -> None:
    """Check every row has the columns of `fmt`, each a string or a message list as required.

    Standard vs conversational is decided by the first row and then required of all rows
    (mixing the two in one dataset is an error). Raises `DataFormatError` naming the row
    location (`path:line` for JSON Lines, `path: row N` otherwise: rows loaded by
    `sources.load_rows` know where they came from), the column, what was expected and
    what was found. An empty dataset is an error too.
    """
    if fmt not in FORMAT_COLUMNS:
        raise DataFormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMAT_COLUMNS)}")
    name = source_name or getattr(rows, "name", None) or "dataset"
    locate = getattr(rows, "locate", None) or _default_locate(name)
    if len(rows) == 0:
        raise DataFormatError(f"{name}: no rows")
    required = FORMAT_COLUMNS[fmt]
    conversational = fmt in _CHAT_ONLY_COLUMNS or is_conversational(rows[0], fmt)
    kind = "conversational" if conversational else "standard (string)"
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataFormatError(f"{locate(i)}: expected a row object, got {type(row).__name__}")
        for col in required:
            if col not in row or row[col] is None:
                what = "is missing" if col not in row else "is null"
                raise DataFormatError(
                    f"{locate(i)}: column {col!r} {what}; expected columns {', '.join(required)}; "
                    f"found {', '.join(map(str, row)) or 'no columns'} (format {fmt!r})"
                )
            problem = _value_problem(row[col], conversational)
            if problem is not None:
                expected, found = problem
                raise DataFormatError(
                    f"{locate(i)}: column {col!r}: expected {expected}, found {found}"
                    f"{_kind_hint(col, row[col], i, required, kind)}"
                )


def _kind_hint(col: str, value: Any, i: int, required: tuple[str, ...], kind: str) -> str:
    if col in _CHAT_ONLY_COLUMNS and isinstance(value, str):
        return " (CSV cannot hold message lists; use JSON Lines, JSON or Parquet)"
    if i > 0:
        return f" (row 1 is {kind}; every row must be)"
    if len(required) > 1:
        return f" (column {required[0]!r} is {kind}; {', '.join(required)} must all be)"
    return ""


def split_implicit_prompt(chosen: str | list, rejected: str | list) -> tuple[Any, Any, Any]:
    """Split an implicit-prompt preference pair into (prompt, chosen, rejected).

    The prompt is the longest shared prefix, as in TRL's `extract_prompt`: for strings, the
    common characters, with a space just before the first difference moved to the responses
    ("Q: 2+2? A: 4" / "Q: 2+2? A: 5" gives prompt "Q: 2+2? A:" and responses " 4" / " 5", the
    split BPE tokenizers expect); for message lists, the common leading messages, compared
    whole. Both responses are kept non-empty: when one side is a prefix of the other, the
    last shared element goes back to the responses.
    """
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise DataFormatError(
            f"chosen and rejected must both be strings or both message lists; "
            f"found {_describe(chosen)} and {_describe(rejected)}"
        )
    if chosen == rejected:
        raise DataFormatError("chosen and rejected are identical; a preference pair must differ")
    limit = min(len(chosen), len(rejected))
    if limit == 0:
        raise DataFormatError("chosen and rejected must both be non-empty")
    n = 0
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    n = min(n, limit - 1)
    if isinstance(chosen, str) and n > 0 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]
