"""data/ sits below the model and engine layers (DESIGN.md, "Layers"): it imports none of them."""

import ast
from pathlib import Path

import posttrain

ABOVE = ("posttrain.models", "posttrain.rollout", "posttrain.rewards", "posttrain.workers", "posttrain.trainers",
         "posttrain.evaluation", "posttrain.sample_preferences", "posttrain.cli")


def test_data_imports_nothing_above_it():
    found = []
    for path in sorted((Path(posttrain.__file__).parent / "data").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith(ABOVE)]
    assert found == []
