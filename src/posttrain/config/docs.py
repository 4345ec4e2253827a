"""Generate `docs/config.md` from the config trees: the field docstrings are the only source.

    python -m posttrain.config.docs > docs/config.md

One Markdown section per training command, one table per config section (dotted key,
type, default, description), then the TRL / veRL / OpenRLHF names of our keys (the aliases
the fields declare, `posttrain.config.aliases`). `tests/test_docs.py` fails when the file is
out of date.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from collections.abc import Iterator
from typing import Any

from posttrain.config.aliases import (
    LIBRARIES,
    Alias,
    alias_summary,
    aliases_by_key,
    iter_aliases,
    yaml_value,
)
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
        "Commands: " + ", ".join(f"[`posttrain {name}`](#posttrain-{name})" for name in COMMANDS) + ". "
        "Coming from TRL, veRL or OpenRLHF: [their names for these keys](#trl-verl-and-openrlhf-names).\n",
    ]
    parts += [_command(name, cls) for name, cls in COMMANDS.items()]
    parts += [render_alias_tables(), _python_api()]
    return "\n".join(parts)


def _python_api() -> str:
    """The section on the `python_api` record of config.yaml (`posttrain.config.inputs`)."""
    from posttrain.config import inputs

    body = (inputs.__doc__ or "").split("\n\n", 1)[1].strip()  # the module doc past its title line
    return f"## Runs started from Python\n\n{body}\n"


def render_alias_tables() -> str:
    """The section of docs/config.md that maps other libraries' options to our keys: one
    table per library, one row per (their name, our key), with the commands it applies to."""
    rows: dict[tuple[Alias, str], list[str]] = {}
    for command, cls in COMMANDS.items():
        for key, alias in iter_aliases(cls):
            rows.setdefault((alias, key), []).append(command)
    lines = [
        "## TRL, veRL and OpenRLHF names\n",
        "Their option → the posttrain key that does the same, for the commands listed. Typed as a\n"
        "key (`num_generations=8`, `actor_rollout_ref.rollout.n=8`), each is answered with the\n"
        "posttrain key and the value to write. Values carry over as they are unless the last column\n"
        "says how they read here. Declared on the config fields (`posttrain.config.aliases`).\n",
    ]
    for library in LIBRARIES:
        mine = sorted(((a.name, key, a, cmds) for (a, key), cmds in rows.items() if a.library == library),
                      key=lambda row: row[:2])
        lines += [f"### {library}\n", "| their option | posttrain key | commands | values, notes |",
                  "|---|---|---|---|"]
        lines += [f"| `{name}` | `{key}` | {', '.join(cmds)} | {_cell(_alias_values(a))} |"
                  for name, key, a, cmds in mine]
        lines.append("")
    return "\n".join(lines)


def _alias_values(alias: Alias) -> str:
    """The last column of an alias row: how their values read here, and the note."""
    if alias.values is None:
        values = "no value carries over as it is"
    else:
        values = ", ".join(f"`{yaml_value(t)}` → `{yaml_value(o)}`" for t, o in alias.values)
    return "; ".join(p for p in (values, _code_keys(alias.note)) if p)


def _code_keys(text: str) -> str:
    """A note with its `key=value` words and dotted keys in code spans."""
    return re.sub(r"(?<![`\w])([a-z_]+(?:\.[a-z_]+)+(?:=[^\s,;()]+)?|[a-z_]+=[^\s,;()]+)", r"`\1`", text)


def _command(name: str, cls: type) -> str:
    lines = [f"## posttrain {name}\n", f"`{cls.__name__}`: {_text(class_doc(cls))}\n"]
    sections = {key: (tp, doc) for key, tp, doc in config_sections(cls)}
    rows: dict[str, list[str]] = {key: [] for key in sections}
    also = aliases_by_key(cls)
    for key, tp, default, doc in iter_fields(cls):
        section = key.rsplit(".", 1)[0]
        same = alias_summary(also.get(key, ()))
        doc += f" Also: {same}." if same else ""
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
