"""Generate `docs/config.md` from the config trees: the field docstrings are the only source.

    python -m posttrain.config.docs > docs/config.md

One Markdown section per training command, one table per config section (dotted key,
type, default, description). `tests/test_docs.py` fails when the file is out of date.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from collections.abc import Iterator
from typing import Any

from posttrain.config.core import _is_config_class, field_docs, iter_fields, type_name
from posttrain.config.preference import DPOConfig, RMConfig
from posttrain.config.rl import GRPOConfig, PPOConfig
from posttrain.config.sft import SFTConfig

REGENERATE = "python -m posttrain.config.docs > docs/config.md"

COMMANDS: dict[str, type] = {
    "sft": SFTConfig,
    "rm": RMConfig,
    "dpo": DPOConfig,
    "grpo": GRPOConfig,
    "ppo": PPOConfig,
}
"""`posttrain CMD` → its config tree (the same pairs as `posttrain.cli`; a test checks)."""


def config_sections(cls: type, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """Yield `(dotted_key, section_class, field_doc)` for every section below `cls`, depth first."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_config_class(tp):
            key = prefix + f.name
            yield key, tp, docs.get(f.name, "")
            yield from config_sections(tp, key + ".")


def class_doc(cls: type) -> str:
    """The docstring written on `cls` ("" for the signature a dataclass makes up)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(cls.__name__ + "(") else inspect.cleandoc(doc)


def render_config_docs() -> str:
    """The whole of `docs/config.md`."""
    parts = [
        "# Configuration reference\n",
        f"<!-- Generated from the config dataclasses; do not edit. Regenerate with: {REGENERATE} -->\n",
        "Generated from the field docstrings in `src/posttrain/config/`. Regenerate with\n",
        f"    {REGENERATE}\n",
        "Set a key on the command line as `key=value` (lists as `key=[a,b]`) or in a YAML preset\n"
        "(`--config recipes/NAME.yaml`); `posttrain CMD --help` prints the same list. The\n"
        "algorithms behind the options are in [algorithms.md](algorithms.md).\n",
        "Commands: " + ", ".join(f"[`posttrain {name}`](#posttrain-{name})" for name in COMMANDS) + ".\n",
    ]
    parts += [_command(name, cls) for name, cls in COMMANDS.items()]
    return "\n".join(parts)


def _command(name: str, cls: type) -> str:
    lines = [f"## posttrain {name}\n", f"`{cls.__name__}`: {_text(class_doc(cls))}\n"]
    sections = {key: (tp, doc) for key, tp, doc in config_sections(cls)}
    rows: dict[str, list[str]] = {key: [] for key in sections}
    for key, tp, default, doc in iter_fields(cls):
        section = key.rsplit(".", 1)[0]
        rows[section].append(
            f"| `{key}` | {_cell(_code(type_name(tp)))} | {_cell(_code(_default(default)))} | {_cell(doc)} |"
        )
    for key, (tp, doc) in sections.items():
        if not rows[key]:
            continue
        lines.append(f"### {name}: `{key}`\n")
        lines.append(f"{_text(doc)} `{tp.__name__}`: {_text(class_doc(tp))}\n")
        lines += ["| key | type | default | description |", "|---|---|---|---|", *rows[key], ""]
    return "\n".join(lines)


def _default(value: Any) -> str:
    """A default as it is written in YAML and on the command line."""
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_default(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_default(v)}" for k, v in value.items()) + "}"
    return str(value)


def _code(text: str) -> str:
    return f"`{text}`"


def _text(text: str) -> str:
    """A docstring as one line of Markdown: `<` and `*` outside code spans are escaped, so
    `reward/<fn>/errors` is not read as an HTML tag nor `data/*` as emphasis."""
    spans = re.sub(r"\s+", " ", text).strip().split("`")
    spans[::2] = [re.sub(r"([<*])", r"\\\1", s) for s in spans[::2]]
    return "`".join(spans)


def _cell(text: str) -> str:
    """One table cell: `_text`, with `|` escaped (also inside code spans, as GFM wants)."""
    return _text(text).replace("|", "\\|")


def main() -> None:
    sys.stdout.reconfigure(encoding="utf-8", newline="\n")  # the docs hold σ, ε, →: never the locale's codec
    sys.stdout.write(render_config_docs())


if __name__ == "__main__":
    main()
