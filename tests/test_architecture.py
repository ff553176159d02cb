"""mldebug's import layers: each layer imports only those below it, and no module takes
part in an import circle.

The graph counts every import an `ast` walk finds, module level or inside a function,
and the `sys.modules.get("mldebug....")` look-ups that no import tool sees: the graph
the tests draw is the graph that runs.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mldebug"

# bottom to top; a module belongs to the longest prefix that names it
LAYERS = [
    ("mldebug.core", 0),          # records, break-on, session, frames, replay, quiet, errors
    ("mldebug.summaries", 1),     # a tensor at a glance, norms, slices
    ("mldebug.remedies", 1),      # what a stop most likely comes from and its usual fix
    ("mldebug.watch", 2),         # the engines: NaN/Inf sentinel, graph capture
    ("mldebug.graph", 2),
    ("mldebug.assertions", 3),    # ... and those built on the graph's events
    ("mldebug.record", 3),
    ("mldebug.figures", 3),       # what every front end draws alike: the graph figure
    ("mldebug.view", 4),          # the front ends' pieces
    ("mldebug.dap", 4),
    ("mldebug.interrupt", 4),
    ("mldebug.peers", 4),         # the ranks of a job telling each other about stops
    ("mldebug.prompt", 5),        # the prompt's ML commands and its IPython terminal
    ("mldebug.debugger", 6),      # the prompt
    ("mldebug.frontends", 7),     # which front end pauses a session none was set up for
    ("mldebug.integrations", 7),  # framework callbacks: the engines started from inside
    ("mldebug.remote_prompt", 7),  # a rank's prompt on a socket when its terminal is hidden
    ("mldebug.attach", 7),        # ... and its client, `python -m mldebug attach HOST:PORT`
    ("mldebug.notebook", 7),      # IPython/Jupyter: %load_ext mldebug, its magics
    ("mldebug.cli", 8),
    ("mldebug.__main__", 9),
    ("mldebug", 9),               # the package face
]
MAX_LINES = 600   # "modules a newcomer can hold"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> tuple[str, int]:
    best = max((prefix for prefix, _ in LAYERS
                if module == prefix or module.startswith(prefix + ".")), key=len)
    return best, dict(LAYERS)[best]


def _resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


# imports an `import` statement scan does not see, named by a string
DYNAMIC_IMPORTS = {"sys.modules.get", "importlib.import_module", "import_module", "__import__"}


def imports_of(name: str, path: Path) -> set[str]:
    """The mldebug modules NAME imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mldebug"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                module = _resolve(name, is_package, node.level, node.module)
            elif (node.module or "").startswith("mldebug"):
                module = node.module
            else:
                continue
            for alias in node.names:      # `from pkg import submodule` names a module
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in MODULES else module)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).startswith("mldebug")
              and ast.unparse(node.func) in DYNAMIC_IMPORTS):
            found.add(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules"
              and isinstance(node.slice, ast.Constant)
              and str(node.slice.value).startswith("mldebug")):
            found.add(node.slice.value)
    found.discard(name)
    # importing mldebug.a.b runs mldebug/__init__ and mldebug/a/__init__ first: that is
    # Python's doing, not an edge of this module
    return {m for m in found if m in MODULES}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(GRAPH) == []


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module's own layer or one above it, from another package."""
    upward = []
    for importer, targets in graph.items():
        group, rank = layer_of(importer)
        for target in targets:
            target_group, target_rank = layer_of(target)
            if target_group == group:
                continue               # inside one package (its circles are checked above)
            if target_rank >= rank:
                upward.append(f"{importer} (layer {rank}) -> {target} (layer {target_rank})")
    return upward


def test_every_import_points_down_or_stays_in_its_package():
    assert upward_edges(GRAPH) == []


def test_modules_are_small_enough_to_hold():
    big = {name: n for name, path in MODULES.items()
           if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_the_checks_see_what_they_claim(tmp_path):
    """The walk finds function-local imports and the look-ups by name, and flags a circle
    and an upward or sideways edge: a check that cannot fail would pass anything."""
    source = ("import importlib, sys\n"
              "def f():\n    from .records import Stop\n"
              "def g():\n    return sys.modules.get('mldebug.core.session')\n"
              "def h():\n    return importlib.import_module('mldebug.watch')\n"
              "def i():\n    return sys.modules['mldebug.view'], __import__('mldebug.dap')\n")
    probe = tmp_path / "probe.py"     # read as if it were mldebug/core/probe.py
    probe.write_text(source)
    found = imports_of("mldebug.core.probe", probe)
    assert found == {"mldebug.core.records", "mldebug.core.session", "mldebug.watch",
                     "mldebug.view", "mldebug.dap"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("mldebug.watch.core") == ("mldebug.watch", 2)
    up = upward_edges({"mldebug.watch.core": {"mldebug.view", "mldebug.graph.model",
                                              "mldebug.core.records", "mldebug.watch.ops"}})
    assert sorted(up) == ["mldebug.watch.core (layer 2) -> mldebug.graph.model (layer 2)",
                          "mldebug.watch.core (layer 2) -> mldebug.view (layer 4)"]


@pytest.mark.parametrize("name", ["mldebug.core.records", "mldebug.core.session"])
def test_the_bottom_layer_imports_nothing_above_it(name):
    assert all(layer_of(t)[1] == 0 for t in GRAPH[name])
