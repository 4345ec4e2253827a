"""What a run started from the Python API was given in place of config keys, in config.yaml.

A trainer given `train_dataset`, `eval_dataset` or `reward_funcs` from Python records them
in its config.yaml, so that the file says what the run trained on and a rerun from it
(`posttrain CMD --config RUN_DIR/config.yaml`, or a resume) either reproduces it or says
what is missing:

    data.train_files / data.eval_files   the dataset's files, when it came from files; else []
    reward.functions                     each function's spec when one loads it again (a
                                         built-in, `module:function`, `file.py:function`),
                                         else its `module:qualname`
    rollout.env / rollout.tools          likewise for `environment_factory` and `tools`
    python_api:                          what was passed:
      train_dataset: {files: [...] | type: datasets.Dataset, rows: 120, sha256: ...}
      eval_dataset:  {...}
      reward_funcs:  [{name, callable: module:qualname, file, spec (null: not loadable by name)}]
      environment_factory: {callable, file, spec}
      tools:         [{callable, file, spec}]

`sha256` is `posttrain.data.sources.rows_sha256` of the rows (one sorted-key JSON line each),
so the same rows give it from a list, a `datasets.Dataset` or a file. The training rows'
count and sha256 are part of the run's fingerprint: a resume on other rows is refused, as
one with another data.train_files is.

`build_config` reads the `python_api` section of a config file (it is no setting) and
refuses, before anything loads, a rerun that lacks what the file cannot hold: an in-memory
training set (set data.train_files), a reward function, an environment or a tool that
cannot be loaded by name (set reward.functions, rollout.env, rollout.tools). An in-memory eval set left out gives a warning (the run has no held-out
evaluation then).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from posttrain.config.core import ConfigError, _plain

log = logging.getLogger(__name__)

SECTION = "python_api"
"""config.yaml's top-level key for what the Python API was given."""

DESCRIBED_ONLY = (f"{SECTION}.reward_funcs", f"{SECTION}.train_dataset.files", f"{SECTION}.train_dataset.type",
                  f"{SECTION}.train_dataset.hf_fingerprint", f"{SECTION}.eval_dataset.*",
                  f"{SECTION}.environment_factory.*", f"{SECTION}.tools")
"""Keys of the record that describe rather than define the run (where a function's file is,
what type held the rows): a resume may see them change. The training rows' count and sha256
must match, as data.train_files must (`posttrain.checkpoint.RESUME_MAY_CHANGE`)."""


def recorded_config(config: Mapping[str, Any], inputs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`config` (a `to_dict` tree) as config.yaml records it for a run given `inputs` (the
    `python_api` record; None: nothing came from Python, `config` as it is)."""
    out = dict(config)
    if not inputs:
        return out
    inputs = _plain(inputs)  # YAML-ready: a factory's tuple option becomes a list
    data = dict(out["data"])
    for given, key in (("train_dataset", "train_files"), ("eval_dataset", "eval_files")):
        if inputs.get(given) is not None:
            data[key] = list(inputs[given].get("files", []))
    out["data"] = data
    if inputs.get("reward_funcs"):
        out["reward"] = {**out["reward"], "functions": [_entry(r) for r in inputs["reward_funcs"]]}
    if "environment_factory" in inputs or "tools" in inputs:
        rollout = dict(out["rollout"])
        if "environment_factory" in inputs:
            rollout["env"] = _entry(inputs["environment_factory"])
        if "tools" in inputs:
            rollout["tools"] = [_entry(t) for t in inputs["tools"]]
        out["rollout"] = rollout
    out[SECTION] = inputs
    return out


def _entry(described: Mapping[str, Any]) -> Any:
    """The config entry of a described object: its spec (a copy: no YAML alias), else its
    `module:qualname`."""
    return _plain(described["spec"]) if described.get("spec") is not None else described["callable"]


def check_rerun(record: Mapping[str, Any], cfg: Any, source: str) -> None:
    """Refuse a config read from `source` whose `python_api` record says its run had what the
    file cannot hold and the overrides did not supply; warn about an eval set left out."""
    where = f"{source} is the config.yaml of a run started from Python"
    train = record.get("train_dataset")
    if train and "files" not in train and not cfg.data.train_files:
        raise ConfigError(
            f"data.train_files: {where} with an in-memory train_dataset ({_rows(train)}), which a config file "
            "cannot hold. Write those rows to a file (e.g. dataset.to_json('train.jsonl'), or one JSON object a "
            "line) and pass data.train_files=[train.jsonl]; posttrain.data.sources.rows_sha256 of the same rows "
            f"gives {train.get('sha256')}")
    held_out = record.get("eval_dataset")
    if held_out and "files" not in held_out and not cfg.data.eval_files:
        log.warning("%s with an in-memory eval_dataset (%s), which a config file cannot hold: this run has no "
                    "held-out evaluation unless you pass data.eval_files=[...]", where, _rows(held_out))
    rollout = getattr(cfg, "rollout", None)
    given = [("reward.functions", "reward functions", record.get("reward_funcs", []),
              list(getattr(getattr(cfg, "reward", None), "functions", []))),
             ("rollout.env", "an environment", [record["environment_factory"]] if "environment_factory" in record
              else [], [getattr(rollout, "env", None)]),
             ("rollout.tools", "tools", record.get("tools", []), list(getattr(rollout, "tools", [])))]
    for key, what, described, now in given:
        lost = [r for r in described if r.get("spec") is None and r.get("callable") in now]
        if lost:
            shown = "; ".join(f"{r['callable']} (in {r.get('file') or 'an unknown file'})" for r in lost)
            raise ConfigError(
                f"{key}: {where} with {what} that cannot be loaded by name: {shown} (a lambda, a closure, a "
                "callable object or a definition of the script run as __main__). Move each to a module and name "
                f"it in {key} as module:name or path/to/file.py:name")


def _rows(described: Mapping[str, Any]) -> str:
    return (f"{described.get('type', 'rows')} of {described.get('rows')} rows, "
            f"sha256 {str(described.get('sha256'))[:16]}…")
