"""Config trees: YAML + dotted overrides, key/type/combination checks, field docs."""

import copy
import functools
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from posttrain.config import (
    ConfigError,
    SFTConfig,
    build_config,
    field_docs,
    iter_fields,
    save_config,
)
from posttrain.config.core import coerce, parse_override

BASE = ["model.init=tiny", "data.train_files=[train.jsonl]"]


@dataclass
class _Inner:
    size: int = 3
    """How big."""
    names: list[str] = field(default_factory=list)
    """Some names."""


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    """The inner section."""
    mode: Literal["a", "b"] = "a"
    """Which mode."""
    rate: float = 0.5
    """A rate."""


def test_defaults_yaml_then_overrides(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("inner:\n  size: 7\nrate: 0.1\n")
    cfg = build_config(_Outer, preset, ["rate=2e-3", "inner.names=[x,y]"])
    assert cfg.inner.size == 7  # from YAML
    assert cfg.rate == pytest.approx(2e-3)  # the override wins over YAML; `2e-3` is a float
    assert cfg.inner.names == ["x", "y"]
    assert cfg.mode == "a"  # default


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"trainer\.lerning_rate.*Did you mean trainer\.learning_rate\?"):
        build_config(SFTConfig, None, [*BASE, "trainer.lerning_rate=1"])
    with pytest.raises(ConfigError, match=r"Did you mean data\.train_files\?"):
        build_config(SFTConfig, None, [*BASE, "data.train_file=[x]"])


def test_wrong_type_names_field_and_type():
    with pytest.raises(ConfigError, match=r"trainer\.max_steps: expected int \| null, got 'ten'"):
        build_config(SFTConfig, None, [*BASE, "trainer.max_steps=ten"])
    with pytest.raises(ConfigError, match=r"mode: 'c' is not a valid choice; expected one of 'a' \| 'b'"):
        build_config(_Outer, None, ["mode=c"])
    with pytest.raises(ConfigError, match=r"inner: expected a mapping"):
        build_config(_Outer, None, ["inner=3"])


def test_impossible_combination():
    with pytest.raises(ConfigError, match=r"trainer\.micro_batch_size: 5 must divide data\.train_batch_size=32"):
        build_config(SFTConfig, None, [*BASE, "trainer.micro_batch_size=5"])
    with pytest.raises(ConfigError, match=r"model\.path: set only one"):
        build_config(SFTConfig, None, ["model.init=tiny", "model.path=/x", "data.train_files=[a]"])


@pytest.mark.parametrize("override, message", [
    # issue #31 item 2: learning_rate=inf trained every weight to ±inf and exited 0
    ("trainer.learning_rate=inf", "trainer.learning_rate: must be a finite number, got inf"),
    ("trainer.learning_rate=.nan", "trainer.learning_rate: must be a finite number, got nan"),
    ("trainer.max_grad_norm=-.inf", "trainer.max_grad_norm: must be a finite number, got -inf"),
    ("trainer.adam_betas=[0.9,inf]", "trainer.adam_betas: must be a finite number, got [0.9, inf]"),
    ("trainer.adam_betas=[0.9,1.0]", "trainer.adam_betas: each beta must be in [0, 1), got [0.9, 1.0]"),
    ("trainer.adam_betas=[-0.1,0.99]", "trainer.adam_betas: each beta must be in [0, 1)"),
    ("trainer.adam_eps=0", "trainer.adam_eps: must be > 0, got 0.0"),
    ("trainer.weight_decay=-0.1", "trainer.weight_decay: must be >= 0, got -0.1"),
    ("trainer.max_grad_norm=-1", "trainer.max_grad_norm: must be >= 0 (0: no clipping), got -1.0"),
    ("trainer.seed=-1", "trainer.seed: must be in [0, 2**32 - 1] (NumPy's range), got -1"),
    ("trainer.seed=4294967296", "trainer.seed: must be in [0, 2**32 - 1]"),
    ("model.lora.dropout=nan", "model.lora.dropout: must be a finite number, got nan"),
])
def test_a_number_where_it_means_nothing_is_refused_naming_the_option(override, message):
    with pytest.raises(ConfigError) as err:
        build_config(SFTConfig, None, [*BASE, override])
    assert str(err.value).startswith(message)


def test_every_float_option_of_every_command_is_checked_finite():
    """The check is generic (every float field of every section), not a list to keep up."""
    from posttrain.config import GRPOConfig
    from posttrain.config.core import validate_tree

    base = build_config(GRPOConfig, None, BASE)
    floats = [key for key, tp, _default, _ in iter_fields(GRPOConfig) if tp is float]
    assert len(floats) > 20
    for key in floats:
        cfg = copy.deepcopy(base)
        *sections, name = key.split(".")
        setattr(functools.reduce(getattr, sections, cfg), name, float("inf"))
        with pytest.raises(ConfigError, match=f"^{key}: must be a finite number"):
            validate_tree(cfg)
    assert build_config(SFTConfig, None, [*BASE, "trainer.seed=4294967295"]).trainer.seed == 2**32 - 1


def test_coerce_rules():
    assert coerce("3", int, "k") == 3
    assert coerce(4.0, int, "k") == 4
    assert coerce("true", bool, "k") is True
    assert coerce("x.jsonl", list[str], "k") == ["x.jsonl"]  # a scalar becomes a one-element list
    assert coerce(None, int | None, "k") is None
    with pytest.raises(ConfigError):
        coerce(1.5, int, "k")
    with pytest.raises(ConfigError):
        coerce(True, float, "k")


def test_parse_override():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=null") == ("a", None)
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("trainer.max_steps")


def test_every_field_is_documented():
    missing = [key for key, _, _, doc in iter_fields(SFTConfig) if not doc]
    assert not missing, f"fields without a docstring: {missing}"
    assert "peak learning rate" in field_docs(type(SFTConfig().trainer))["learning_rate"].lower()


def test_saved_config_round_trips(tmp_path):
    cfg = build_config(SFTConfig, None, [*BASE, "trainer.max_steps=7"])
    save_config(cfg, tmp_path / "config.yaml")
    again = build_config(SFTConfig, tmp_path / "config.yaml")
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["max_steps"] == 7


def test_cli_bad_key_exits_nonzero_before_loading():
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "sft", *BASE, "trainer.lerning_rate=1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "trainer.learning_rate" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_recipe_resolves_with_its_command_config():
    from pathlib import Path

    from posttrain.config import DPOConfig, GRPOConfig, PPOConfig, RMConfig

    by_prefix = {"sft_": SFTConfig, "rm_": RMConfig, "dpo_": DPOConfig, "ppo": PPOConfig}
    recipes = sorted(Path(__file__).parents[1].joinpath("recipes").glob("*.yaml"))
    assert len(recipes) >= 10
    for path in recipes:
        cls = next((c for p, c in by_prefix.items() if path.name.startswith(p)), GRPOConfig)
        build_config(cls, path)  # every key known, every value valid


def recipe_config_class(name):
    """The command config a shipped recipe is written for (sft_*, rm_*, dpo_*, ppo, else grpo)."""
    from posttrain.config import DPOConfig, GRPOConfig, PPOConfig, RMConfig

    by_prefix = {"sft_": SFTConfig, "rm_": RMConfig, "dpo_": DPOConfig, "ppo": PPOConfig}
    return next((c for p, c in by_prefix.items() if name.startswith(p)), GRPOConfig)


def recipe_task_logs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "posttrain.config.core"]


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml")))
def test_a_recipe_gives_its_task_settings_up_to_the_users_own_data(name, caplog):
    """`posttrain grpo --config grpo data.train_files=[mine.jsonl]`: the arithmetic task's held-out
    file, eval task and run folder go (they stopped such a run before it started), in one line."""
    from posttrain.config.core import RECIPE_TASK_KEYS, RECIPES, load_yaml

    cls, recipe = recipe_config_class(name), load_yaml(RECIPES / f"{name}.yaml")
    set_by_recipe = {k: recipe[k.split(".")[0]][k.split(".")[1]] for k in RECIPE_TASK_KEYS
                     if k.split(".")[1] in recipe.get(k.split(".")[0], {})}
    assert "trainer.output_dir" in set_by_recipe and "data.eval_files" in set_by_recipe
    kept = build_config(cls, name, ["trainer.seed=3"])  # the recipe's own data: all kept
    assert all(lookup(kept, k) == v for k, v in set_by_recipe.items()) and not recipe_task_logs(caplog)
    with caplog.at_level("INFO", logger="posttrain"):
        own = build_config(cls, name, ["data.train_files=[mine.jsonl]"])
    defaults = cls()
    assert own.data.train_files == ["mine.jsonl"]
    assert {k: lookup(own, k) for k in set_by_recipe} == {k: lookup(defaults, k) for k in set_by_recipe}
    assert own.trainer.output_dir == f"runs/{cls.command}"
    [line] = recipe_task_logs(caplog)
    assert line.startswith(f"recipe {name}: data.train_files names your own data, so the recipe's task settings "
                           f"are dropped: data.eval_files={set_by_recipe['data.eval_files'][0].join('[]')}")
    assert f"trainer.output_dir={set_by_recipe['trainer.output_dir']}" in line
    assert line.endswith("set any of them on the command line to keep it")


def test_what_the_command_line_names_itself_stays(caplog):
    from posttrain.config import GRPOConfig

    with caplog.at_level("INFO", logger="posttrain"):
        cfg = build_config(GRPOConfig, "grpo", ["data={train_files: [mine.jsonl]}", "eval.task=arithmetic",
                                                "trainer.output_dir=runs/mine"])
    assert (cfg.eval.task, cfg.trainer.output_dir, cfg.data.eval_files) == ("arithmetic", "runs/mine", [])
    [line] = recipe_task_logs(caplog)
    assert "data.eval_files=[data/arith/test.jsonl]" in line and "eval.task" not in line
    own_file = build_config(GRPOConfig, Path(__file__).parents[1] / "recipes" / "grpo.yaml", [])
    assert own_file.eval.task == "arithmetic"  # through the repository's recipes/ link: still the recipe


def lookup(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_a_shipped_recipe_resolves_by_name_from_any_directory(tmp_path, monkeypatch):
    from posttrain.config import GRPOConfig
    from posttrain.config.core import RECIPES, recipe_names, resolve_config_file

    monkeypatch.chdir(tmp_path)  # no recipes/ folder here, as after `pip install`
    assert {"grpo", "dapo", "ppo", "sft_arithmetic"} <= set(recipe_names())
    for name in ("dapo", "dapo.yaml", "recipes/dapo.yaml"):
        assert resolve_config_file(name) == RECIPES / "dapo.yaml"
    assert build_config(GRPOConfig, "dapo").algorithm.filter_groups is True
    own = tmp_path / "recipes" / "dapo.yaml"  # a file of the user's own wins
    own.parent.mkdir()
    own.write_text("trainer: {max_steps: 7}\n")
    assert build_config(GRPOConfig, "recipes/dapo.yaml").trainer.max_steps == 7
    with pytest.raises(ConfigError, match="shipped recipes are .*grpo"):
        build_config(GRPOConfig, "nope")


def test_a_recipe_may_interpolate_another_key(tmp_path):
    from posttrain.config import GRPOConfig

    preset = tmp_path / "p.yaml"
    preset.write_text("critic:\n  learning_rate: ${trainer.learning_rate}\nreward: {functions: [task_reward]}\n")
    assert build_config(GRPOConfig, preset).critic.learning_rate == 1e-4  # a default: nobody set it
    cfg = build_config(GRPOConfig, preset, ["trainer.learning_rate=3e-5"])
    assert cfg.critic.learning_rate == pytest.approx(3e-5)  # resolved after the overrides
    out = build_config(SFTConfig, None, [*BASE, "trainer.output_dir=runs/${model.init}", r"eval.task=\${x}"])
    assert (out.trainer.output_dir, out.eval.task) == ("runs/tiny", "${x}")  # \${ is a literal ${
    with pytest.raises(ConfigError, match=r"critic\.learning_rate: Interpolation key 'trainer\.lerning_rate' not found"):
        build_config(GRPOConfig, preset, ["critic.learning_rate=${trainer.lerning_rate}"])


@dataclass
class _Values:
    text: str = "d"
    """Some text."""
    maybe: str | None = "d"
    """Text or null."""
    flag: bool = False
    """A switch."""
    rate: float = 0.5
    """A rate."""
    names: list[str] = field(default_factory=list)
    """Some names."""


@pytest.mark.parametrize(
    "override,expected",
    [
        # Where OmegaConf's dotlist loader reads a value differently, we keep the old reading:
        ("maybe=", ("maybe", "")),  # OmegaConf: null
        ("text=1e-4", ("text", "1e-4")),  # OmegaConf: 0.0001 (a float field still reads 1e-4)
        ("rate=1e-4", ("rate", 1e-4)),
        ("text=@home", ("text", "@home")),  # OmegaConf: a YAML scanner error
        ("text=%x", ("text", "%x")),  # OmegaConf: a YAML directive error
        # Read the same by both, pinned here:
        ("maybe=null", ("maybe", None)),
        ("flag=true", ("flag", True)),
        ("text='1'", ("text", "1")),
        ("text=a=b", ("text", "a=b")),
        ("names=[my.rewards:fn, rewards.py:score]", ("names", ["my.rewards:fn", "rewards.py:score"])),
        ("names=x.jsonl", ("names", ["x.jsonl"])),
        # Changed: a bare date was a datetime.date (an error for a str field); OmegaConf holds no dates.
        ("text=2024-01-01", ("text", "2024-01-01")),
    ],
)
def test_override_values_read_as_before(override, expected):
    key, value = expected
    assert getattr(build_config(_Values, None, [override]), key) == value


def test_yaml_values_read_as_before(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("text: 2024-01-01\nmaybe:\nrate: 1e-4\nnames: [a:b]\n")
    cfg = build_config(_Values, preset)
    assert (cfg.text, cfg.maybe, cfg.rate, cfg.names) == ("2024-01-01", None, 1e-4, ["a:b"])


def test_overrides_apply_in_order_and_merge_sections():
    cfg = build_config(_Outer, None, ["inner={size: 4, names: [a]}", "inner.size=5", "rate=1", "rate=2"])
    assert (cfg.inner.size, cfg.inner.names, cfg.rate) == (5, ["a"], 2.0)
    with pytest.raises(ConfigError, match=r"rate: expected float, got \{'x': 1\}"):
        build_config(_Outer, None, ["rate.x=1"])


def test_a_bad_or_missing_device_is_a_config_error_before_loading():
    import torch

    with pytest.raises(ConfigError, match=r"model\.device: 'gpu' is not a device; expected auto, cpu, cuda or cuda:N"):
        build_config(SFTConfig, None, [*BASE, "model.device=gpu"])
    if torch.cuda.is_available():
        build_config(SFTConfig, None, [*BASE, "model.device=cuda"])
    else:
        with pytest.raises(ConfigError, match=r"model\.device: cuda is not available.*model\.device=cpu"):
            build_config(SFTConfig, None, [*BASE, "model.device=cuda"])
    with pytest.raises(ConfigError, match=r"model\.device: cuda:99"):
        build_config(SFTConfig, None, [*BASE, "model.device=cuda:99"])
    assert build_config(SFTConfig, None, [*BASE, "model.device=cpu"]).model.device == "cpu"


def test_a_command_line_model_source_replaces_the_recipes(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {init: tiny}\ndata: {train_files: [a]}\n")
    cfg = build_config(SFTConfig, recipe, ["model.path=/my/model"])
    assert (cfg.model.path, cfg.model.init) == ("/my/model", None)
    recipe.write_text("model: {path: runs/sft/final}\ndata: {train_files: [a]}\n")
    cfg = build_config(SFTConfig, recipe, ["model.init=tiny"])
    assert (cfg.model.path, cfg.model.init) == (None, "tiny")
    assert build_config(SFTConfig, recipe, ["model={init: small}"]).model.path is None
    # Both in one source is still a mistake, and the error says how to clear one.
    with pytest.raises(ConfigError, match=r"model\.path: set only one.*model\.init=null"):
        build_config(SFTConfig, recipe, ["model.init=tiny", "model.path=/x"])
    recipe.write_text("model: {path: /x, init: tiny}\ndata: {train_files: [a]}\n")
    with pytest.raises(ConfigError, match=r"model\.init=null"):
        build_config(SFTConfig, recipe)


def test_warmup_past_max_steps_warns(caplog):
    build_config(SFTConfig, None, [*BASE, "trainer.max_steps=10", "trainer.warmup_steps=9"])
    assert "warmup_steps" not in caplog.text
    build_config(SFTConfig, None, [*BASE, "trainer.max_steps=10", "trainer.warmup_steps=10"])
    assert "trainer.warmup_steps=10 >= trainer.max_steps=10" in caplog.text


@pytest.mark.parametrize("value", ["[a,,]", "[{a: 1}", "[rewards.py:fn", "{a: 1", " [a, , b]"])
def test_a_malformed_list_is_refused_not_read_as_a_glob_or_a_module(value):
    with pytest.raises(ConfigError, match=r"^names: malformed list or mapping .* write a list as \[a,b\]"):
        build_config(_Values, None, [f"names={value}"])
    with pytest.raises(ConfigError, match="^text: malformed list"):  # a str field too: quote it to mean text
        build_config(_Values, None, [f"text={value}"])
    assert build_config(_Values, None, ["text='[unclosed'"]).text == "[unclosed"


@pytest.mark.parametrize("override,message", [
    ("trainer.eval_steps=-1", "trainer.eval_steps: must be >= 0 (0: only at the end), got -1"),
    ("trainer.save_steps=-2", "trainer.save_steps: must be >= 0 (0: only at the end), got -2"),
    ("trainer.output_dir=", "trainer.output_dir: is empty; name the run's folder"),
    ("trainer.output_dir=' '", "trainer.output_dir: is empty"),
])
def test_each_cadence_and_the_output_dir_are_checked_under_their_own_name(override, message):
    with pytest.raises(ConfigError) as caught:
        build_config(SFTConfig, None, [*BASE, override])
    assert str(caught.value).startswith(message)


def test_a_huge_micro_batch_is_checked_at_once():
    # The hint's divisor search was O(batch) and ran even when the check passed: 1e9 took minutes.
    start = time.perf_counter()
    cfg = build_config(SFTConfig, None, [*BASE, "data.train_batch_size=1000000000", "trainer.micro_batch_size=1000000000"])
    assert cfg.trainer.micro_batch_size == 10**9 and time.perf_counter() - start < 1.0
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size: 7 must divide data.train_batch_size=1000000000 "
                       r"\(e.g. trainer.micro_batch_size=5\)"):
        build_config(SFTConfig, None, [*BASE, "data.train_batch_size=1000000000", "trainer.micro_batch_size=7"])
