"""Turn a reward spec from a config or the command line into a (name, function) pair.

    resolve_reward("math_accuracy")                                  # a built-in function
    resolve_reward("format_reward")                                  # a factory, default options
    resolve_reward({"name": "overlong_penalty", "max_len": 512, "buffer_len": 128})
    resolve_reward({"name": "code_tests", "timeout_s": 2.0})         # a function's defaults
    resolve_reward("mypkg.rewards:my_reward")                        # importable module
    resolve_reward("rewards/my_rewards.py:my_reward")                # a file, by path
    resolve_reward({"name": "mypkg.rewards:make_reward", "threshold": 0.5})  # factory(**options)
    resolve_reward(my_function)                                      # a callable as it is

The name is the built-in's name or the function's `__name__` (for `module:function`, the
function part); it keys the metrics (`reward/<name>/mean`). Options given with an import
path mean the target is a factory: it is called with them and must return the function.
Options given with a built-in that is a plain function set its keyword defaults.

The other way round, `describe_reward(fn)` says how config.yaml records a function that the
Python API was given: the spec that loads it again, when it has one (a built-in, a factory's
function with its `reward_spec`, a top-level function of an importable module or of a file
loaded by path), its `module:qualname` and its file.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.rewards.builtin import BUILTIN_REWARDS, REWARD_FACTORIES
from posttrain.user_code import UserCodeError, user_code

__all__ = ["describe_object", "describe_reward", "load_object", "pickle_file_modules_by_value", "resolve_reward"]

RewardFn = Callable[..., Any]

FILE_MODULES: dict[str, ModuleType] = {}
"""The modules `load_object` loaded from files (by their made-up names, `_load_file`) or found in
the working folder (`_import_module`): pickled by value."""


def resolve_reward(spec: str | Mapping[str, Any] | RewardFn) -> tuple[str, RewardFn]:
    """(name, reward function) for a built-in name, an options dict, an import path or a callable."""
    if callable(spec) and not isinstance(spec, str):
        return getattr(spec, "__name__", type(spec).__name__), spec
    if isinstance(spec, Mapping):
        options = dict(spec)
        target = options.pop("name", None)
        if not isinstance(target, str):
            raise ValueError(
                f"reward spec {dict(spec)!r} needs a 'name' (a built-in or 'module:function')"
            )
    elif isinstance(spec, str):
        target, options = spec, {}
    else:
        raise TypeError(f"a reward spec is a name, a dict or a callable, got {spec!r}")

    if ":" in target and target not in BUILTIN_REWARDS:
        obj = load_object(target)
        name = target.rpartition(":")[2]
        is_factory = bool(options)
    else:
        if target not in BUILTIN_REWARDS:
            raise ValueError(_unknown_message(target))
        obj, name = BUILTIN_REWARDS[target], target
        is_factory = target in REWARD_FACTORIES
        if options and not is_factory:
            return name, _bind_options(target, obj, options)
    if is_factory:
        try:
            obj = obj(**options)
        except TypeError as e:
            raise ValueError(f"reward {target!r} with options {options}: {e}") from None
    if not callable(obj):
        raise ValueError(f"reward {target!r} is {_show(obj)}, not a function: name a function, or a "
                         "factory with options that returns one")
    return name, obj


def _bind_options(target: str, fn: RewardFn, options: dict[str, Any]) -> RewardFn:
    """`fn` with some of its keyword parameters that have defaults set (code_tests' timeout_s)."""
    settable = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = sorted(set(options) - set(settable))
    if unknown:
        raise ValueError(
            f"reward {target!r} has no option {', '.join(unknown)}; its options: {settable or 'none'}"
        )
    bound = functools.partial(fn, **options)
    functools.update_wrapper(bound, fn)
    bound.reward_spec = {"name": target, **options}  # type: ignore[attr-defined]
    return bound


def describe_reward(spec: str | Mapping[str, Any] | RewardFn) -> dict[str, Any]:
    """How config.yaml records a reward function passed to a trainer from Python:

        {"name": ..., "callable": "module:qualname", "file": path or None, "spec": ...}

    `spec` is what `reward.functions` can hold to load the same function again (a built-in
    name or options dict, `module:function`, `path/file.py:function`), or None when nothing
    can (a lambda, a closure, a callable object, a function of the script run as __main__)."""
    if isinstance(spec, (str, Mapping)):
        return {"name": spec if isinstance(spec, str) else spec.get("name"), "spec": spec}
    return {"name": resolve_reward(spec)[0], **describe_object(spec, BUILTIN_REWARDS)}


def describe_object(obj: Any, builtins: Mapping[str, Any]) -> dict[str, Any]:
    """{"callable": "module:qualname", "file": its source file or None, "spec": the name in
    `builtins`, its `reward_spec`, or the `module:name` / `file.py:name` that `load_object`
    loads it from again; None when none does}: how config.yaml records a function or class
    (a reward function, an environment, a tool) that the Python API was given."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or f"{type(target).__qualname__} instance"
    try:
        file = inspect.getsourcefile(target if inspect.isroutine(target) or inspect.isclass(target) else type(target))
    except TypeError:
        file = None
    return {"callable": f"{module}:{qualname}", "file": str(Path(file).resolve()) if file else None,
            "spec": _spec_of(obj, builtins, module, qualname, file)}


def _spec_of(obj: Any, builtins: Mapping[str, Any], module: str, qualname: str, file: str | None) -> Any:
    """The config entry that loads `obj` again, or None."""
    recorded = getattr(obj, "reward_spec", None)
    if recorded is not None:
        return recorded
    builtin = [name for name, known in builtins.items() if known is obj]
    if builtin:
        return builtin[0]
    top_level = (inspect.isfunction(obj) or inspect.isclass(obj)) and "." not in qualname and "<" not in qualname
    if not top_level or module == "__main__":
        return None
    target = f"{file}:{qualname}" if module in FILE_MODULES and file else f"{module}:{qualname}"
    try:
        found = load_object(target)
    except (ValueError, ImportError):
        return None
    return target if found is obj else None


def load_object(path: str) -> Any:
    """The object at 'package.module:attr' or 'path/to/file.py:attr'."""
    module_part, _, attr = path.rpartition(":")
    if not module_part or not attr:
        raise ValueError(f"reward {path!r}: expected 'module:function' or 'file.py:function'")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module = _load_file(module_part, path)
    else:
        try:
            with user_code(f"the module {module_part!r}"):
                module = _import_module(module_part)
        except UserCodeError as e:
            missing = getattr(e.__cause__, "name", None)  # ModuleNotFoundError: the module itself is not there
            if not isinstance(e.__cause__, ModuleNotFoundError) or not (
                    module_part == missing or module_part.startswith(f"{missing}.")):
                raise
            raise ValueError(
                f"reward {path!r}: cannot import module {module_part!r} from the working folder "
                f"{os.getcwd()!r} or the installed packages ({e.__cause__})"
            ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        near = difflib.get_close_matches(attr, public, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else f"; it defines {public}"
        raise ValueError(f"reward {path!r}: {module_part!r} has no {attr!r}{hint}") from None


def _import_module(name: str) -> ModuleType:
    """Module `name`, found as `python -m` finds it: the working folder first on sys.path (the
    `posttrain` console script puts its own bin folder there, a Python caller its script's
    folder). One found in the working folder is pickled by value, as a file's module is (a
    Ray worker elsewhere may not have that folder)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    module = importlib.import_module(name)
    top = getattr(sys.modules[name.partition(".")[0]], "__file__", None)  # None: built in, or a namespace
    origin = Path(top).resolve() if top else None
    if origin and (origin.parent.parent if origin.name == "__init__.py" else origin.parent) == Path(cwd).resolve():
        _pickle_by_value(module)
    return module


def _pickle_by_value(module: ModuleType) -> None:
    """Have cloudpickle pickle what `module` defines by value (`pickle_file_modules_by_value`)."""
    FILE_MODULES[module.__name__] = module
    try:
        import cloudpickle
    except ImportError:  # nothing pickles it by value then; Ray registers it with its own copy
        return
    cloudpickle.register_pickle_by_value(module)


def _load_file(file: str, spec: str) -> Any:
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward {spec!r}: no such file {str(path)!r}")
    # A name unique per path, so two `rewards.py` files in different folders never collide,
    # registered in sys.modules so pickling and dataclasses inside the file work; cloudpickle
    # pickles the module by value (`pickle_file_modules_by_value`).
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"posttrain_user_rewards_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        with user_code(f"the file {str(path)!r}"):
            module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _pickle_by_value(module)
    return module


def pickle_file_modules_by_value(pickler: Any) -> None:
    """Have `pickler` (a cloudpickle module: Ray vendors its own, `ray.cloudpickle`) pickle
    what the files loaded so far define by value: its class or function travels with its
    code, since another process (a Ray worker) cannot import the module by its made-up name."""
    for module in FILE_MODULES.values():
        pickler.register_pickle_by_value(module)


def _unknown_message(name: str) -> str:
    near = difflib.get_close_matches(name, BUILTIN_REWARDS, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
    return (
        f"unknown reward {name!r}{hint}; built-ins: {', '.join(sorted(BUILTIN_REWARDS))}; "
        "or give an import path 'package.module:function' or 'path/to/file.py:function'"
    )


def _show(obj: Any) -> str:
    text = repr(obj)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(obj).__name__})"
