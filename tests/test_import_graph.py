"""The import graph of src/flashsink has no cycle, counting the imports inside functions too (a deferred
import that closes a cycle hides a layer reaching back up: custom_ops -> interface -> custom_ops was
one). Read from the source with ast: nothing is imported."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "flashsink"


def _modules() -> dict:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _targets(node, module: str, package: bool, modules: dict) -> set:
    """The flashsink modules an import statement loads (``from . import x`` loads x when it is one)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module.split(".") if package else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module
        names = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in modules]
        if not names:
            names = [prefix]
    return {n for n in names if n in modules and n != module}


def import_graph() -> dict:
    """module -> the modules it imports, anywhere in its body; a package's own submodules left out of
    its edges (``__init__`` gathering its parts is not a cycle)."""
    modules = _modules()
    graph = {}
    for module, (path, package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(node, module, package, modules)
        graph[module] = {t for t in edges if not (package and t.startswith(module + "."))}
    return graph


def _cycle(graph: dict):
    """One cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


@pytest.mark.l0
def test_no_import_cycle():
    graph = import_graph()
    assert "flashsink.ops.interface" in graph["flashsink.ops.custom_ops"]  # the graph is read at all
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.l0
def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
