"""The shape of the source tree: no import cycle, no long module (docs/architecture.md, "Layers").

Every module under src/clockwork_async and executors/ (shipped as clockwork_async.executors) is
parsed with ``ast``; every import counts, wherever it is written: at the top, inside a function,
or under ``if TYPE_CHECKING:`` (a cycle that only type checkers follow is still a cycle of
ideas). Relative imports are resolved against the importing module's package.

Rules checked:
- the module import graph has no cycle;
- no module is over ``MAX_LINES`` lines, and one over ``ONE_IDEA_LINES`` says in its docstring
  why it is one idea: a line that starts with ``One idea:``.

The two allow-lists below name offenders outside core/ that other work is fixing now; the lead
empties them. Nothing in core/ may ever be listed, and a stale entry fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "clockwork_async"
SOURCE_ROOTS = (
    (ROOT / "src" / PACKAGE, PACKAGE),
    (ROOT / "executors", f"{PACKAGE}.executors"),
)
CORE = f"{PACKAGE}.core"
MAX_LINES = 500
ONE_IDEA_LINES = 400
ONE_IDEA_MARK = "One idea:"

# The core's layers, lowest first (core/controller.py's header): a core module imports only
# from its own layer or lower ones. Every core module is listed.
CORE_LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "errors",
        "outcomes",
        "events",
        "config",
        "percentile",
        "profiles",
        "capacity",
        "clock",
        "models",
        "buckets",
    ),
    ("queues", "lanes", "entities"),
    ("state",),
    ("agenda", "feasibility", "eviction", "room", "quotes", "ledger"),
    ("requests", "warm_up"),
    ("batching", "policies"),
    ("admission", "scheduler", "results", "membership", "placement", "reservations"),
    ("stats", "controller"),
)

# Import edges (importer, imported) outside core/ that close a cycle today; ignored by the
# cycle check until their owners break them. Empty it, do not grow it.
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset({})

# Modules outside core/ that are over MAX_LINES, or over ONE_IDEA_LINES without a "One idea:"
# line, today (2026-12-07). Empty it, do not grow it.
KNOWN_LONG_MODULES: frozenset[str] = frozenset()


def module_files() -> dict[str, Path]:
    """Return every module of the tree by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for folder, prefix in SOURCE_ROOTS:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def _resolve(base: str, level: int, module: str | None) -> str:
    """Return the absolute name ``from <level dots><module>`` names inside package ``base``."""
    if level:
        parts = base.split(".")
        base = ".".join(parts[: len(parts) - (level - 1)])
        return f"{base}.{module}" if module else base
    return module or ""


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """Return the longest known module that ``name`` is or lies inside, or None (not ours)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_in(name: str, is_package: bool, source: str, modules: dict[str, Path]) -> Iterator[str]:
    """Yield the modules of the tree that module ``name`` (its ``source``) imports, anywhere."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(package, node.level, node.module)
            targets = [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            found = _known(target, modules)
            if found is not None and found != name:
                yield found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {
        name: set(imports_in(name, path.name == "__init__.py", path.read_text("utf-8"), modules))
        for name, path in modules.items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return one cycle (a path back to its start) per strongly connected component of more
    than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """Return a shortest cycle through the first member of ``component`` (breadth first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")  # pragma: no cover


def one_idea_said(path: Path) -> bool:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return any(line.strip().startswith(ONE_IDEA_MARK) for line in docstring.splitlines())


def long_offenders(modules: dict[str, Path]) -> dict[str, str]:
    """Return the modules breaking the length rule, each with why."""
    offenders: dict[str, str] = {}
    for name, path in modules.items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            offenders[name] = f"{lines} lines (over {MAX_LINES})"
        elif lines > ONE_IDEA_LINES and not one_idea_said(path):
            offenders[name] = f"{lines} lines and no {ONE_IDEA_MARK!r} line in its docstring"
    return offenders


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return module_files()


def test_the_tree_is_found(modules: dict[str, Path]) -> None:
    assert f"{CORE}.controller" in modules
    assert f"{PACKAGE}.executors.host" in modules


def test_no_import_cycle(modules: dict[str, Path]) -> None:
    graph = import_graph(modules)
    for importer, imported in KNOWN_CYCLE_EDGES:
        graph[importer].discard(imported)
    cycles = [" -> ".join(cycle) for cycle in find_cycles(graph)]
    assert not cycles, "import cycles (one per tangle of modules):\n" + "\n".join(cycles)


def test_the_core_keeps_its_layers(modules: dict[str, Path]) -> None:
    layer_of = {
        f"{CORE}.{name}": layer for layer, names in enumerate(CORE_LAYERS) for name in names
    }
    core_modules = {name for name in modules if name.startswith(f"{CORE}.")}
    assert sorted(core_modules - set(layer_of)) == [], "place each new core module in a layer"
    graph = import_graph(modules)
    upward = [
        f"{name} (layer {layer_of[name] + 1}) imports {imported} (layer {layer_of[imported] + 1})"
        for name in sorted(core_modules)
        for imported in sorted(graph[name])
        if layer_of.get(imported, -1) > layer_of[name]
    ]
    assert not upward, "\n".join(upward)


def test_no_long_module(modules: dict[str, Path]) -> None:
    offenders = long_offenders(modules)
    unexpected = {name: why for name, why in offenders.items() if name not in KNOWN_LONG_MODULES}
    assert not unexpected, "\n".join(f"{name}: {why}" for name, why in sorted(unexpected.items()))


def test_the_allow_lists_are_current_and_spare_the_core(modules: dict[str, Path]) -> None:
    listed = {*KNOWN_LONG_MODULES, *(name for edge in KNOWN_CYCLE_EDGES for name in edge)}
    assert not [name for name in listed if name == CORE or name.startswith(f"{CORE}.")]
    graph = import_graph(modules)
    stale_edges = [edge for edge in KNOWN_CYCLE_EDGES if edge[1] not in graph.get(edge[0], ())]
    assert not stale_edges, f"no longer imported, remove from KNOWN_CYCLE_EDGES: {stale_edges}"
    stale_long = sorted(KNOWN_LONG_MODULES - set(long_offenders(modules)))
    assert not stale_long, f"no longer too long, remove from KNOWN_LONG_MODULES: {stale_long}"


def test_the_checks_see_what_they_must() -> None:
    """The graph walk finds TYPE_CHECKING, nested and relative imports, and a cycle."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import B\n"
        "def f() -> None:\n    from ..other import thing\n"
    )
    modules = {name: Path() for name in ("p.q.a", "p.q.b", "p.other")}
    sources = {"p.q.a": source, "p.q.b": "from . import a\n", "p.other": ""}
    graph = {name: set(imports_in(name, False, sources[name], modules)) for name in modules}
    assert graph == {"p.q.a": {"p.q.b", "p.other"}, "p.q.b": {"p.q.a"}, "p.other": set()}
    assert find_cycles(graph) == [["p.q.a", "p.q.b", "p.q.a"]]
