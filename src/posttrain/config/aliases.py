"""Other libraries' names for our config keys: TRL's arguments, veRL's dotted keys, OpenRLHF's flags.

Each config field declares its aliases in its dataclass metadata, the one place they are written:

    n: int = field(default=8, metadata=aliases(trl("num_generations"), verl("actor_rollout_ref.rollout.n")))

`alias_table(SFTConfig)` collects them for a command's tree. An unknown key that is an alias
is answered with the real key (and the value translated where the two libraries spell it
differently, `use_vllm=true` → `rollout.engine=vllm`); `posttrain CMD --help` and
docs/config.md show the aliases of every key, and docs/config.md has the table in full.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator
from typing import Any

LIBRARIES = ("TRL", "veRL", "OpenRLHF")
"""The libraries whose names are declared, in the order the docs list them."""


@dataclasses.dataclass(frozen=True)
class Alias:
    """Another library's name for one config key."""

    library: str
    """TRL, veRL or OpenRLHF."""
    name: str
    """Their option as they spell it: a TRL argument (`num_generations`), a veRL dotted key
    (`actor_rollout_ref.rollout.n`), an OpenRLHF flag without its dashes."""
    values: tuple[tuple[Any, Any], ...] | None = ()
    """How their values read here: () = as they are; (their value, ours) pairs where they are
    spelt differently; None = no value carries over as it is (`note` says what to set)."""
    note: str = ""
    """What else to know or set, when the key alone does not carry the meaning."""
    only_with: str = ""
    """A top-level section the command's tree must have for the alias to apply ("" = any):
    `rollout` keeps veRL's actor_rollout_ref.* keys to the RL commands."""

    def translate(self, value: Any) -> Any:
        """Our value for their `value`, or None when there is no single one."""
        if self.values is None:
            return None
        if not self.values:
            return value
        for theirs, ours in self.values:
            if type(theirs) is type(value) and theirs == value:
                return ours
        return None

    def describe_values(self) -> str:
        """Their values → ours, e.g. `grpo → seq-mean-token-mean, dapo → token-mean` ("" when
        the values carry over as they are, or do not at all)."""
        return ", ".join(f"{yaml_value(t)} → {yaml_value(o)}" for t, o in self.values or ())


def trl(name: str, values: dict[Any, Any] | None = None, note: str = "", *, same_value: bool = True) -> Alias:
    """A TRL (or transformers TrainingArguments / peft) argument; see `Alias`."""
    return _alias("TRL", name, values, note, same_value)


def verl(name: str, values: dict[Any, Any] | None = None, note: str = "", *, same_value: bool = True) -> Alias:
    """A veRL key, dotted from the root of its config (`actor_rollout_ref.actor.optim.lr`).
    Its actor_rollout_ref.* and critic.* keys exist in its RL trainer only: they apply to the
    RL commands."""
    alias = _alias("veRL", name, values, note, same_value)
    return dataclasses.replace(alias, only_with="rollout") if name.startswith(("actor_rollout_ref.", "critic.")) else alias


def openrlhf(name: str, values: dict[Any, Any] | None = None, note: str = "", *, same_value: bool = True) -> Alias:
    """An OpenRLHF command-line flag, without its dashes (`n_samples_per_prompt`)."""
    return _alias("OpenRLHF", name, values, note, same_value)


def _alias(library: str, name: str, values: dict[Any, Any] | None, note: str, same_value: bool) -> Alias:
    pairs = tuple(values.items()) if values else ()
    return Alias(library, name, pairs if same_value else None, note)


def aliases(*items: Alias) -> dict[str, tuple[Alias, ...]]:
    """Field metadata declaring the aliases of a config key."""
    return {"aliases": items}


def yaml_value(value: Any) -> str:
    """`value` as it is typed on the command line: true, null, [a, b]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


# ---------------------------------------------------------------------------------------
# The table of a config tree
# ---------------------------------------------------------------------------------------


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def field_aliases(cls: type) -> dict[str, tuple[Alias, ...]]:
    """The aliases declared on each field of dataclass `cls`: a field a subclass redeclares
    (`PPORolloutConfig.n`, a command's `trainer.output_dir`) keeps those of its base."""
    out: dict[str, tuple[Alias, ...]] = {}
    for klass in reversed(cls.__mro__):
        for f in getattr(klass, "__dataclass_fields__", {}).values():
            if f.metadata.get("aliases"):
                out[f.name] = f.metadata["aliases"]
    return out


def iter_aliases(cls: type) -> Iterator[tuple[str, Alias]]:
    """Yield `(our dotted key, alias)` for every alias that applies to the config tree `cls`."""
    sections = {f.name for f in dataclasses.fields(cls)}
    for key, alias in _declared(cls):
        if not alias.only_with or alias.only_with in sections:
            yield key, alias


def _declared(cls: type, prefix: str = "") -> Iterator[tuple[str, Alias]]:
    hints = typing.get_type_hints(cls)
    declared = field_aliases(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            yield from _declared(hints[f.name], f"{prefix}{f.name}.")
        else:
            for alias in declared.get(f.name, ()):
                yield prefix + f.name, alias


def aliases_by_key(cls: type) -> dict[str, tuple[Alias, ...]]:
    """Our dotted key → the aliases that apply to it in the config tree `cls` (help and docs)."""
    out: dict[str, tuple[Alias, ...]] = {}
    for key, alias in iter_aliases(cls):
        out[key] = (*out.get(key, ()), alias)
    return out


@functools.cache
def alias_table(cls: type) -> dict[str, tuple[str, Alias]]:
    """Their name → (our dotted key, alias) for the config tree `cls`. A name claimed by two
    keys of one tree is a mistake in the declarations (a test builds every command's table);
    one that two libraries share (`learning_rate`) is answered in the first one's name."""
    table: dict[str, tuple[str, Alias]] = {}
    for key, alias in iter_aliases(cls):
        if alias.name in table and table[alias.name][0] != key:
            raise ValueError(f"{cls.__name__}: alias {alias.name} is declared on both "
                             f"{table[alias.name][0]} and {key}")
        table.setdefault(alias.name, (key, alias))  # the first library declared (TRL) names a shared one
    return table


def lookup(cls: type, key: str) -> tuple[str, Alias] | None:
    """The alias entry for an unknown dotted `key` of the tree `cls`: `key` itself, else its
    last part when that is an undotted alias (`trainer.gradient_accumulation_steps`)."""
    table = alias_table(cls)
    if key in table:
        return table[key]
    leaf = key.rsplit(".", 1)[-1]
    hit = table.get(leaf)
    return hit if hit is not None and "." not in hit[1].name else None


def suggestion(key: str, value: Any, target: str, alias: Alias) -> str:
    """What to write instead of `key=value`, an alias of our `target`, in one sentence or two.

        unknown key use_vllm: TRL's use_vllm is rollout.engine here. Did you mean rollout.engine=vllm?
    """
    ours = alias.translate(value)
    head = (f"{alias.library}'s {alias.name} is {target} here" if alias.values is not None else
            f"{alias.library}'s {alias.name} has no key of its own here")
    if ours is None and alias.values:
        head += f" ({alias.describe_values()})"
    if alias.note:
        head += f"; {alias.note}"
    fix = f"{target}={yaml_value(ours)}" if ours is not None else target
    return f"unknown key {key}: {head}. Did you mean {fix}?"


def alias_summary(aliases: tuple[Alias, ...]) -> str:
    """`TRL num_generations; veRL actor_rollout_ref.rollout.n` for a key's --help and docs line:
    the aliases that are the same option (not those whose values do not carry over, such as
    gradient_accumulation_steps for data.train_batch_size; docs/config.md's table has those)."""
    by_library: dict[str, list[str]] = {}
    for a in aliases:
        if a.values is not None:
            by_library.setdefault(a.library, []).append(f"`{a.name}`")
    return "; ".join(f"{lib} {', '.join(names)}" for lib, names in by_library.items())
