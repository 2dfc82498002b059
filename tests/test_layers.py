"""The package's layers look only down: an import graph read from the source (imports inside
functions included, ``TYPE_CHECKING`` blocks aside) has no edge to a higher layer and no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import spdl_lab

PACKAGE = Path(spdl_lab.__file__).parent

# Lowest first; a module's layer is that of its top-level name under spdl_lab (the README's
# Layout section has this table). Names in one row may import each other, except the pairs
# in APART.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_pipeline", "_json", "_table", "_views", "_file_checks", "_interpreter", "_progress", "_forksafe",
     "_startup"),
    ("_telemetry", "_training"),
    ("_engine",),
    ("_runners",),
    ("_runs", "_loader"),
    ("_integrations", "workloads"),
    ("_experiments",),
    ("_diagnose", "_tune"),
    ("_watch",),
    ("_ui",),
    ("cli", "_cli_inputs", "_magics", "__main__", "__init__"),
]
APART = {frozenset({"_diagnose", "_tune"})}
#: ``%load_ext spdl_lab`` finds the magics through the package: the one edge allowed up.
ALLOWED = {("spdl_lab", "spdl_lab._magics"), ("spdl_lab._magics", "spdl_lab")}


#: Training scripts shipped as data (``lab.workloads.job_script``): run as a user's ``__main__``,
#: never imported by the package, so no layer; one may use the public API as a user does.
SCRIPTS = PACKAGE / "workloads" / "jobs"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if SCRIPTS in path.parents:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _in_type_checking(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.level == 0:
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        base = module.split(".")
        if path.name != "__init__.py":
            base.pop()
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
        names = [f"{prefix}.{alias.name}" for alias in node.names]
    found = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES:
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _in_type_checking(tree)
        graph[module] = {
            target
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped
            for target in _targets(module, path, node)
            if target != module
        }
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    top = _top(module)
    for level, names in enumerate(LAYERS):
        if top in names:
            return level
    raise AssertionError(f"{module} is in no layer: add {top!r} to LAYERS and to the README's table")


def test_every_module_has_a_layer_and_every_layer_name_a_module():
    for module in MODULES:
        layer_of(module)
    stale = {name for names in LAYERS for name in names} - {_top(module) for module in MODULES}
    assert not stale, f"LAYERS names modules that are gone: {sorted(stale)}"


def test_no_import_goes_up():
    graph = import_graph()
    up = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if (module, target) not in ALLOWED
        and (layer_of(target) > layer_of(module) or frozenset({_top(module), _top(target)}) in APART)
    ]
    assert not up, "imports that go up a layer:\n" + "\n".join(up)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    cycles = [c for c in _cycles(import_graph()) if set(c) != {"spdl_lab", "spdl_lab._magics"}]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert _cycles(graph) == expected


def test_the_graph_sees_imports_inside_functions():
    # spdl_lab/__init__.py imports the magics only inside load_ipython_extension
    assert "spdl_lab._magics" in import_graph()["spdl_lab"]


#: The house limit on a module's length (issue 27): past it, a module holds more than one job.
MAX_MODULE_LINES = 450


def test_no_module_is_over_the_house_limit():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}; split each along its jobs"
