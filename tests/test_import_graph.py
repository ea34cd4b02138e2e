"""The import graph of src/flashsink has no cycle, counting the imports inside functions too (a deferred
import that closes a cycle hides a layer reaching back up: custom_ops -> dense -> custom_ops was
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
    assert "flashsink.ops.launch.dense" in graph["flashsink.ops.launch.custom_ops"]  # the graph is read at all
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.l0
def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


#: what each layer of flashsink.ops may import from flashsink.ops (ops/__init__.py; each package's
#: docstring says the same); a module of a layer may always import its own layer
LAYERS = {
    "flashsink.ops.tir": set(),
    "flashsink.ops.kernels": {"flashsink.ops.tir"},
    "flashsink.ops.compiler": {"flashsink.ops.kernels"},  # the builders, imported when a kernel is built
    "flashsink.ops.launch": {"flashsink.ops.compiler"},
}
#: what the modules outside flashsink.ops may import from it: the launch layer and the compile layer
#: (the CLI's cache and precompile commands), never a kernel or a TIR piece
OUTSIDE = {"flashsink.ops.launch", "flashsink.ops.compiler"}
#: the base module every layer imports (KernelConfig and its policy): it imports nothing of flashsink
BASE = "flashsink.kernel_config"


def _layer(module: str):
    """The most specific LAYERS key that ``module`` belongs to, or None outside flashsink.ops."""
    keys = [k for k in LAYERS if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def _inside(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_violations(graph: dict) -> list:
    out = []
    for module, targets in sorted(graph.items()):
        layer = _layer(module)
        for t in sorted(targets):
            if module == BASE:
                out.append(f"{module} -> {t}")
                continue
            if not t.startswith("flashsink.ops.") or t == "flashsink.ops":
                continue
            if layer is None:
                allowed = module == "flashsink.ops" or _inside(t, OUTSIDE)
            else:
                allowed = _inside(t, {layer} | LAYERS[layer])
            if not allowed:
                out.append(f"{module} -> {t}")
    return out


@pytest.mark.l0
def test_layers_import_downward():
    graph = import_graph()
    assert "flashsink.ops.tir.mask" in graph["flashsink.ops.kernels.fwd"]  # the graph is read at all
    assert layer_violations(graph) == []


@pytest.mark.l0
def test_the_layer_check_finds_an_upward_import():
    graph = {"flashsink.ops.tir.mask": {"flashsink.ops.kernels.fwd"},
             "flashsink.ops.launch.dense": {"flashsink.ops.kernels.bwd", "flashsink.ops.compiler.compile"},
             "flashsink.kernel_config": {"flashsink.ops.compiler.kinds"},
             "flashsink.api": {"flashsink.ops.tir.layout", "flashsink.ops.launch.attention"}}
    assert layer_violations(graph) == ["flashsink.api -> flashsink.ops.tir.layout",
                                       "flashsink.kernel_config -> flashsink.ops.compiler.kinds",
                                       "flashsink.ops.launch.dense -> flashsink.ops.kernels.bwd",
                                       "flashsink.ops.tir.mask -> flashsink.ops.kernels.fwd"]


@pytest.mark.l0
def test_every_ops_module_is_in_a_layer():
    stray = [m for m in import_graph() if m.startswith("flashsink.ops.") and _layer(m) is None]
    assert stray == [], "modules of flashsink.ops outside its four layer packages"
