"""Layers point down (DESIGN.md "Layers"): no module imports a module of a higher layer.

Every `posttrain.X` import in `src/posttrain`, at the top of a file or inside a function,
is read from the source (ast), so a lazy import cannot hide an upward edge.
"""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "posttrain"

LAYERS = [
    {"algos"},                                  # pure tensor math: imports torch only
    {"config", "logging"},                      # typed configs, metrics sinks, progress
    {"checkpoint", "user_code"},                # save / resume; user code's errors in one line
    {"data"},                                   # formats, collators, tasks
    {"models"},                                 # built-in decoder, heads, loading, LoRA
    {"training", "rollout", "rewards"},         # training core, engines, reward functions
    {"envs"},                                   # environments and tools: drive rollout, run tools with rewards' sandbox
    {"evaluation", "workers", "distributed"},   # the roles; task evaluation
    {"trainers"},                               # SFT, RM, DPO, RL and the loop
    {"export", "report"},                       # commands on saved runs
    {"serve", "sample_preferences", "demo"},    # commands that run models
    {"cli", "__init__"},                        # the user surface
    {"__main__"},                               # python -m posttrain (torchrun -m posttrain)
]
"""Low to high. A top-level module or package of `posttrain` may import its own modules
and those of lower layers only (not even its neighbours in the same layer)."""

RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def top_level(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def posttrain_imports(path: Path) -> list[tuple[int, str]]:
    """(line, posttrain.X) for every absolute posttrain import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("posttrain.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("posttrain."):
                found.append((node.lineno, node.module))
            elif node.module == "posttrain":
                found += [(node.lineno, f"posttrain.{a.name}") for a in node.names]
    return found


def test_every_module_has_a_layer():
    unknown = sorted({top_level(p) for p in PACKAGE.rglob("*.py")} - RANK.keys())
    assert not unknown, f"place {unknown} in tests/test_layers.py LAYERS (and DESIGN.md's picture)"


def test_no_module_imports_a_higher_or_sibling_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = top_level(path)
        for line, module in posttrain_imports(path):
            target = module.split(".")[1]
            if target != source and RANK.get(target, -1) >= RANK[source]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({source}) imports {module}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_algos_imports_only_torch_and_the_standard_library():
    allowed = {"torch", "posttrain"} | set(sys.stdlib_module_names)
    bad = []
    for path in sorted((PACKAGE / "algos").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] not in allowed or (name.startswith("posttrain.") and
                                                          not name.startswith("posttrain.algos")):
                    bad.append(f"{path.name}:{node.lineno} imports {name}")
    assert not bad, bad


ACYCLIC = ("trainers", "workers", "distributed", "rollout", "rewards", "envs", "algos", "models", "data")
"""Packages whose modules import one another without a cycle (a shared piece sits below both
sides: e.g. `rollout/native_decode.py`, `rewards/base.py`, `trainers/rl_worker.py`)."""


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def import_graph() -> dict[str, set[str]]:
    """posttrain module -> the posttrain modules it imports (a name imported from a package
    counts as its submodule when there is one)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("posttrain"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_inside_the_packages_below_the_cli():
    found = [c for c in cycles(import_graph()) if any(m.split(".")[1] in ACYCLIC for m in c)]
    assert not found, f"import cycles: {found}"
