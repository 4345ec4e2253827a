"""docs/: config.md is generated and up to date; algorithms.md names only things that exist; agents.md's example runs."""

import importlib
import re
from pathlib import Path

import pytest

from posttrain.config.core import coerce, iter_fields, parse_override
from posttrain.config.docs import (
    COMMANDS,
    REGENERATE,
    class_doc,
    config_sections,
    render_config_docs,
)

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8")
SECTIONS = "model|data|rollout|actor|critic|reward|algorithm|trainer|eval"


def test_config_md_is_generated_and_up_to_date():
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert text == render_config_docs(), f"docs/config.md is out of date; regenerate it with: {REGENERATE}"
    assert REGENERATE in text.split("\n## ")[0]  # the header says how


def test_docs_cover_the_cli_training_commands():
    from posttrain.cli import _train_commands

    assert {c.name: c.config_cls for c in _train_commands()} == COMMANDS


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_field_and_section_is_documented(name):
    cls = COMMANDS[name]
    missing = [key for key, _, _, doc in iter_fields(cls) if not doc.strip()]
    missing += [key for key, _, doc in config_sections(cls) if not doc.strip()]
    missing += [tp.__name__ for _, tp, _ in config_sections(cls) if not class_doc(tp)]
    assert class_doc(cls), f"{cls.__name__} has no docstring"
    assert not missing, f"posttrain {name}: without a docstring: {missing}"


def test_table_cells_stay_in_their_columns():
    # A type such as 'token' | 'sequence' must not open extra columns.
    for line in render_config_docs().splitlines():
        if line.startswith("| `"):
            assert len(re.findall(r"(?<!\\)\|", line)) == 5, line


def test_algorithms_md_names_existing_code():
    names = sorted(set(re.findall(r"\bposttrain(?:\.\w+)+", ALGORITHMS)))
    assert "posttrain.algos.policy_loss" in names
    missing = [n for n in names if not _resolves(n)]
    assert not missing, f"docs/algorithms.md names code that does not exist: {missing}"


def test_algorithms_md_names_existing_recipes():
    recipes = sorted(set(re.findall(r"recipes/[\w.-]+\.yaml", ALGORITHMS)))
    assert "recipes/grpo.yaml" in recipes
    missing = [r for r in recipes if not (ROOT / r).is_file()]
    assert not missing, f"docs/algorithms.md names recipes that do not exist: {missing}"


def test_algorithms_md_config_keys_exist_and_values_are_valid():
    types = {key: tp for cls in COMMANDS.values() for key, tp, _, _ in iter_fields(cls)}
    mentions = re.findall(rf"`((?:{SECTIONS})\.[\w.]+(?:=[^`]*)?)`", ALGORITHMS)
    assert "algorithm.adv_estimator=gae" in mentions
    bad = []
    for text in mentions:
        key, value = parse_override(text) if "=" in text else (text, None)
        if key not in types:
            bad.append(f"{key}: no such key")
        elif value is not None:
            try:
                coerce(value, types[key], key)
            except ValueError as err:
                bad.append(str(err))
    assert not bad, f"docs/algorithms.md: {bad}"


def _resolves(dotted: str) -> bool:
    """`posttrain.a.b.c` names a module, or an attribute reached from the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_agents_md_example_runs():
    """The user-environment example of docs/agents.md, as written."""
    text = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    example = text.split("## Example: a user environment")[1].split("```python\n")[1].split("```")[0]
    scope: dict = {"__name__": "agents_example"}
    exec(compile(example, "docs/agents.md", "exec"), scope)
    episodes, metrics = scope["episodes"], scope["metrics"]
    assert len(episodes) == 2 and 1 <= metrics["turns/mean"] <= 3
    assert sorted(scope["Shop"]().tools) == ["calculator", "price"]
