"""Typed configuration: dataclass trees, YAML presets and dotted command-line overrides.

A command's config is a tree of dataclasses. Each field carries its documentation as a
string literal right under it (read with `ast`, so the docs live next to the field and
there is no second copy). `build_config` merges, in order: the defaults, a YAML file, and
`key=value` overrides, then checks every key and type and calls `validate()` on each node,
all before anything heavy (a model, a dataset) is loaded.

    cfg = build_config(SFTConfig, "recipes/sft.yaml", ["trainer.max_steps=100"])
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import logging
import math
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config import aliases

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad configuration: the message names the key and says how to fix it."""


class RunStopped(RuntimeError):
    """A run that stopped itself because it cannot go on (the loss diverged, a reward
    function fails on every sample); the message says why and where its last good state is."""


# ---------------------------------------------------------------------------------------
# Field documentation
# ---------------------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls` (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def iter_fields(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any, Any, str]]:
    """Yield `(dotted_key, type, default, doc)` for every leaf field of a config tree."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + f.name
        if _is_config_class(tp):
            yield from iter_fields(tp, key + ".")
        else:
            yield key, tp, _default_of(f), docs.get(f.name, "")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _is_config_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def type_name(tp: Any) -> str:
    """A short readable name for a field type, used in errors and docs."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple):
        inner = type_name(args[0]) if args else "any"
        return f"list[{inner}]"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------------------------------
# Coercion of one value to a field type
# ---------------------------------------------------------------------------------------


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (from YAML or the command line) to type `tp`, or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key)
            except ConfigError:
                pass
        raise _type_error(key, value, tp)
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{key}: {value!r} is not a valid choice; expected one of {type_name(tp)}.{hint}"
        )
    if origin in (list, tuple):
        items = value if isinstance(value, (list, tuple)) else [value]
        inner = args[0] if args else Any
        out = [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(items)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, value, tp)
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise _type_error(key, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise _type_error(key, value, tp)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key, value, tp)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _type_error(key, value, tp)
    if isinstance(value, tp):
        return value
    raise _type_error(key, value, tp)


def _type_error(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(
        f"{key}: expected {type_name(tp)}, got {value!r} ({type(value).__name__})"
    )


# ---------------------------------------------------------------------------------------
# Building a config tree
# ---------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """YAML without timestamps: OmegaConf holds no dates, so `2024-01-01` stays a string."""

    yaml_implicit_resolvers = {c: [r for r in rs if r[0] != "tag:yaml.org,2002:timestamp"]
                               for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def parse_override(text: str) -> tuple[str, Any]:
    """Split `a.b.c=value` into the key and a YAML-parsed value (`[x,y]` is a list). Values
    read as in a YAML file, not by OmegaConf's dotlist loader: `key=` is "", `1e-4` is text
    until a field's type reads it, and a value that is not YAML (`@x`, `%x`) stays a string,
    except one that opens a list or a mapping (`[a,,]`, `[{a: 1}`): that is a malformed list,
    refused, rather than read as a file glob or a module name."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"cannot read override {text!r}: write overrides as key=value, e.g. trainer.max_steps=100"
        )
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError as err:
        if raw.lstrip()[:1] in ("[", "{"):
            problem = getattr(err, "problem", None) or "not YAML"
            raise ConfigError(f"{key}: malformed list or mapping {raw!r} ({problem}); write a list as [a,b] or "
                              f"[{{k: v}}], and quote a text that starts with a bracket: {key}='{raw}'") from None
        value = raw
    return key, value


def valid_keys(cls: type) -> list[str]:
    """Every dotted key of a config tree, sections included."""
    keys = []
    for key, *_ in iter_fields(cls):
        parts = key.split(".")
        keys += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return list(dict.fromkeys(keys))


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "", root: type | None = None) -> T:
    """Build dataclass `cls` (the section at `prefix` of the tree `root`) from nested `data`,
    checking keys and types (no validate())."""
    root = root or cls
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of options, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(cls, prefix + str(key), value, prefix, root)
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if _is_config_class(tp):
            kwargs[name] = from_dict(tp, value if value is not None else {}, f"{prefix}{name}.", root)
        else:
            try:
                kwargs[name] = coerce(value, tp, prefix + name)
            except ConfigError as err:
                raise _alias_error(prefix + name, value, root, own_key=True) or err from None
    return cls(**kwargs)


RETIRED_KEYS = {
    "rollout.use_rollout_logprobs": (
        "it is gone: for the engine's log-probs as old log-probs with no recompute pass set "
        "algorithm.rollout_correction.bypass_mode=true (no first-batch check, no fallback: the PPO ratio "
        "π_θ / π_rollout carries the gap); to see the gap, rollout.calculate_log_probs=true logs it every "
        "step (rollout_corr/*, docs/rollout_correction.md)"),
}
"""Keys posttrain had and no longer has → what to set instead."""


def _unknown_key(cls: type, key: str, value: Any, prefix: str, root: type) -> ConfigError:
    """The error for `key` (a section of its own when `value` is a mapping), unknown in the
    section `cls` at `prefix` of the tree `root`: a retired key of ours first, then another
    library's name for one of ours (`num_generations` is rollout.n), then a spelling or
    section slip."""
    if key in RETIRED_KEYS:  # `key` is dotted from the root
        return ConfigError(f"{key}: {RETIRED_KEYS[key]}")
    if key == "trainer.async" or key.startswith("trainer.async."):
        leaf = next(iter(_flatten(key, value)))[0]
        ours = "trainer.async_training" + leaf.removeprefix("trainer.async")
        return ConfigError(f"unknown key {key}: the section is trainer.async_training (async is a Python keyword, "
                           f"and a config section is a dataclass field): set {ours}=...")
    alias_error = _alias_error(key, value, root)
    if alias_error is not None:
        return alias_error
    leaves = list(_flatten(key, value))
    key = leaves[0][0] if len(leaves) == 1 else key
    root_keys = valid_keys(cls)
    candidates = [prefix + k for k in root_keys]
    # A field of another section first (RL's trainer.micro_batch_size is actor.micro_batch_size).
    close = [k for k in valid_keys(root) if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]][:1]
    close = close or difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:  # compare the last part alone: `trainer.lr_sched` vs `trainer.lr_scheduler`
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        leaf = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_leaf), n=1, cutoff=0.6)
        close = [by_leaf[leaf[0]]] if leaf else []
    hint = f" Did you mean {close[0]}?" if close else ""
    section = prefix.rstrip(".") or "the config"
    return ConfigError(
        f"unknown key {key}.{hint} (valid keys of {section}: "
        f"{', '.join(sorted(k for k in root_keys if '.' not in k))}; `posttrain CMD --help` lists all)"
    )


def _alias_error(key: str, value: Any, root: type, own_key: bool = False) -> ConfigError | None:
    """The answer to `key=value` when it, or a key below it (`value` a mapping), is another
    library's name for a key of the tree `root` (`posttrain.config.aliases`); else None.
    `own_key`: `key` is ours and `value` does not fit it: a key below it may still be theirs
    (veRL's algorithm.filter_groups.enable), or the value their spelling of one of ours
    (veRL's algorithm.adv_estimator=reinforce_plus_plus)."""
    if own_key and not isinstance(value, dict):
        same = [a for a in aliases.aliases_by_key(root).get(key, ()) if a.name == key and a.values]
        ours = next((a.translate(value) for a in same if a.translate(value) is not None), None)
        return None if ours is None else ConfigError(
            f"{key}: {aliases.yaml_value(value)} is {same[0].library}'s name for {aliases.yaml_value(ours)} here. "
            f"Did you mean {key}={aliases.yaml_value(ours)}?")
    for leaf, leaf_value in _flatten(key, value):
        hit = aliases.lookup(root, leaf)
        if hit is not None:
            return ConfigError(aliases.suggestion(leaf, leaf_value, *hit))
    return None


def _flatten(key: str, value: Any) -> typing.Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf below `key`: `actor_rollout_ref.rollout.n=4` reaches a
    section as {actor_rollout_ref: {rollout: {n: 4}}}."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _flatten(f"{key}.{k}", v)
    else:
        yield key, value


def validate_tree(cfg: Any, prefix: str = "") -> None:
    """Check every number of a config tree is finite (`check_finite`), then call `validate()`
    on every node, leaves first. `prefix` is the dotted key of `cfg` in its tree."""
    for f in dataclasses.fields(cfg):
        child = getattr(cfg, f.name)
        if dataclasses.is_dataclass(child):
            validate_tree(child, f"{prefix}{f.name}.")
        else:
            check_finite(child, prefix + f.name)
    if hasattr(cfg, "validate"):
        cfg.validate()


def check_finite(value: Any, key: str) -> None:
    """Refuse inf and nan in a float option (or a list of them): no option is meaningful at
    infinity, and `trainer.learning_rate=inf` would train every weight to ±inf and exit 0.
    An option that can be switched off takes null (or 0, where its doc says so)."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}: must be a finite number, got {value!r} (no option takes inf or nan; "
                              "see `posttrain CMD --help` for how to switch one off)")


RECIPES = Path(__file__).resolve().parent.parent / "recipes"
"""The recipes shipped inside the package (the repository's `recipes/` links here)."""


def recipe_names() -> list[str]:
    """Names of the shipped recipes, e.g. ["dapo", "grpo", ...]."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def resolve_config_file(path: str | Path) -> Path:
    """A YAML file, or a shipped recipe: `dapo`, `dapo.yaml` or `recipes/dapo.yaml` name
    `RECIPES/dapo.yaml` when no such file exists from here (an installed package has no
    recipes/ folder in the working directory). An existing file always wins."""
    p = Path(path)
    if p.is_file():
        return p
    if str(p.parent) in (".", "recipes"):
        shipped = RECIPES / (p.name if p.suffix else f"{p.name}.yaml")
        if shipped.is_file():
            return shipped
    raise ConfigError(
        f"config file {path} does not exist; the shipped recipes are {', '.join(recipe_names())} "
        "(e.g. --config dapo)"
    )


def build_config(
    cls: type[T],
    config_file: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
) -> T:
    """Defaults ← YAML file (or shipped recipe name, `resolve_config_file`) ← `key=value`
    overrides, merged by OmegaConf with `${a.b}` resolved (a recipe may say
    `critic.learning_rate: ${trainer.learning_rate}`; `\\${` is a literal `${`); then check
    keys, types, finite numbers and combinations. The defaults are merged too, so `${...}`
    may name any key.
    Where a section allows only one of some keys (`one_of`, e.g. model.path and model.init),
    an override of one clears the others the file set: the later source wins. A shipped
    recipe's task settings (RECIPE_TASK_KEYS) give way to data.train_files on the command
    line, with one log line (`give_way_to_own_data`).

    The config.yaml of a run started from Python has a `python_api` section (what it was
    given, `posttrain.config.inputs`): it is no setting; what it says the file lacks must
    come from the overrides (`check_rerun`)."""
    from posttrain.config.inputs import SECTION, check_rerun

    pairs, key = [parse_override(o) for o in overrides], "config"
    data, dropped, record = {}, {}, None
    if config_file is not None:
        path = resolve_config_file(config_file)
        data = load_yaml(path)
        record = data.pop(SECTION, None)
        if is_recipe(path):
            data, dropped = give_way_to_own_data(data, pairs)
    try:
        conf = OmegaConf.merge(to_dict(cls()), data)
        for key in _cleared_by_overrides(cls, pairs):
            OmegaConf.update(conf, key, None)
        for key, value in pairs:
            OmegaConf.update(conf, key, value)
        data = OmegaConf.to_container(conf, resolve=True)  # type: ignore[assignment]
    except (OmegaConfBaseException, ValueError) as err:  # e.g. ${no.such.key}, a.b[9]=1
        raise ConfigError(f"{getattr(err, 'full_key', '') or key}: {str(err).splitlines()[0]}") from None
    cfg = from_dict(cls, data)
    if dropped:
        _log_dropped(Path(config_file).stem, dropped, cfg)
    validate_tree(cfg)
    if record:
        check_rerun(record, cfg, str(config_file))
    return cfg


RECIPE_TASK_KEYS = ("data.eval_files", "eval.task", "trainer.output_dir")
"""What a shipped recipe sets for its own task's data: held-out files, the task that scores
them, a run folder named after it. They give way when the command line names other training
data (`give_way_to_own_data`)."""


def is_recipe(path: Path) -> bool:
    """`path` is one of the shipped recipes (also through the repository's recipes/ link)."""
    return path.resolve().parent == RECIPES.resolve()


def give_way_to_own_data(
    data: dict[str, Any], pairs: list[tuple[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """When the overrides `pairs` set data.train_files: the recipe's `data` without the
    RECIPE_TASK_KEYS the overrides leave unset, and {key: the recipe's value} of those dropped.
    `posttrain grpo --config grpo data.train_files=[mine.jsonl]` then neither looks for the
    arithmetic task's held-out file nor evaluates with its task, and writes to runs/grpo."""
    given = _override_keys(pairs)
    if "data.train_files" not in given:
        return data, {}
    data, dropped = copy.deepcopy(data), {}
    for key in RECIPE_TASK_KEYS:
        section, _, name = key.partition(".")
        if key not in given and name in (data.get(section) or {}):
            dropped[key] = data[section].pop(name)
    return data, dropped


def _override_keys(pairs: list[tuple[str, Any]]) -> set[str]:
    """Every dotted key the overrides set: `data={train_files: [x]}` sets data.train_files."""
    keys = set()
    for key, value in pairs:
        keys |= {k for k, _ in _flatten(key, value)} | {key}
    return keys


def _log_dropped(recipe: str, dropped: dict[str, Any], cfg: Any) -> None:
    """The one line that says what `give_way_to_own_data` dropped, and how to keep it."""
    parts = [f"{k}={aliases.yaml_value(v)}" for k, v in dropped.items()]
    now = (f" (runs go to trainer.output_dir={cfg.trainer.output_dir})"
           if "trainer.output_dir" in dropped else "")
    logging.getLogger(__name__).info(
        "recipe %s: data.train_files names your own data, so the recipe's task settings are dropped: %s%s; "
        "set any of them on the command line to keep it", recipe, ", ".join(parts), now)


def _cleared_by_overrides(cls: type, pairs: list[tuple[str, Any]]) -> list[str]:
    """Keys of a section's `one_of` group (only one may be set) that the overrides leave to
    the file: they are cleared, so that `model.path=X` replaces a recipe's `model.init`. Two
    members set by the overrides alone are kept for `validate()` to refuse."""
    cleared = []
    for prefix, group in _one_of_groups(cls):
        section = prefix.rstrip(".")
        named = set()
        for key, value in pairs:
            if key.startswith(prefix) and key[len(prefix):] in group and value is not None:
                named.add(key[len(prefix):])
            elif key == section and isinstance(value, dict):
                named |= {k for k in group if value.get(k) is not None}
        if named:
            cleared += [prefix + k for k in group if k not in named]
    return cleared


def _one_of_groups(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, tuple[str, ...]]]:
    """(prefix, names) of every section of the tree `cls` that declares a `one_of` group."""
    if getattr(cls, "one_of", ()):
        yield prefix, cls.one_of
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_config_class(hints[f.name]):
            yield from _one_of_groups(hints[f.name], f"{prefix}{f.name}.")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML preset; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config tree as nested plain dicts (lists for tuples), ready for YAML."""
    return _plain(dataclasses.asdict(cfg))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config (a config tree, or its `to_dict`) as YAML (`RUN_DIR/config.yaml`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg if isinstance(cfg, dict) else to_dict(cfg), sort_keys=False))


def check(condition: bool, key: str, message: str) -> None:
    """Raise ConfigError naming `key` unless `condition` holds (for `validate()` methods)."""
    if not condition:
        raise ConfigError(f"{key}: {message}")
