"""The product's modules import each other without a circle, lazy imports included.

Every ``.py`` file of the ``vllm_moonep.*`` namespace is parsed with ``ast`` (nothing is imported),
from the source roots ``pyproject.toml`` lists (``[tool.setuptools.packages.find] where``: each
root holds ``vllm_moonep/<layer>/``). The graph has one node per module (a package is its
``__init__.py``) and an edge ``A -> B`` for every import of ``B`` written in ``A``:

- wherever it is written: at module level, inside a function or method (a lazy import), under
  ``if TYPE_CHECKING:`` (a circle of types is still a circle to a reader, an IDE and mypy), in a
  ``try``; and ``importlib.import_module("vllm_moonep....")`` with a literal name;
- relative imports are resolved against the importing module's package;
- ``import a.b.c`` and ``from a.b import c`` where ``c`` is a submodule: an edge to ``a.b.c`` only;
  ``from a.b import name`` where ``name`` is not a submodule: an edge to ``a.b`` (its ``__init__``).

The rule for packages: importing ``a.b.c`` is no edge to the packages ``a.b`` and ``a`` above it,
although Python runs their ``__init__`` first. So a package ``__init__`` that re-exports its
children (``pkg -> pkg.child``) is no circle with them; it becomes one when a child imports the
package back (``from pkg import name``: ``pkg.child -> pkg``), or when a module the ``__init__``
imports imports something that imports it. A module importing itself (``from . import x`` in an
``__init__`` where ``x`` is a name it defines) is not counted.

``test_the_rule_on_small_trees`` pins the rule on the shapes of the circles it must find (a
dispatcher and its implementations, state in a module that imports its users, a lazy import, a
``TYPE_CHECKING`` import, a child importing its package back) and on the one it must not (a
package re-exporting its children).
"""

from __future__ import annotations

import ast
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMESPACE = "vllm_moonep"


def source_roots(repo: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The folders that hold parts of the namespace, as pyproject.toml lists them."""
    cfg = tomllib.loads((repo / "pyproject.toml").read_text())
    return [repo / w for w in cfg["tool"]["setuptools"]["packages"]["find"]["where"]]


def product_modules(roots: list[pathlib.Path]) -> dict[str, pathlib.Path]:
    """``vllm_moonep.x.y`` -> its file, for every module under each root's ``vllm_moonep/``."""
    mods: dict[str, pathlib.Path] = {}
    for root in roots:
        for path in sorted((root / NAMESPACE).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _base_of_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{name}" if name else package


def imports_of(module: str, path: pathlib.Path, mods: dict[str, pathlib.Path]):
    """``(target, line, unresolved)`` for every import of a ``vllm_moonep`` module written in ``path``:
    ``target`` is the module imported (``None`` when no module of the tree has that name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"

    def resolve(name: str):
        return name if name in mods else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == NAMESPACE or alias.name.startswith(NAMESPACE + "."):
                    if alias.name != NAMESPACE:
                        yield resolve(alias.name), node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = (_base_of_relative(module, is_package, node.level, node.module) if node.level
                    else node.module or "")
            if not (base == NAMESPACE or base.startswith(NAMESPACE + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and sub in mods:
                    yield sub, node.lineno, sub
                elif base != NAMESPACE:
                    yield resolve(base), node.lineno, base
                else:  # from vllm_moonep import <not a layer>
                    yield None, node.lineno, sub
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and node.args[0].value.startswith(NAMESPACE + ".")):
            yield resolve(node.args[0].value), node.lineno, node.args[0].value


def import_graph(roots: list[pathlib.Path]):
    """``(graph, where, unresolved)``: module -> the modules it imports; (A, B) -> the first
    ``file:line`` of that import; and ``file:line name`` of every import no module answers."""
    mods = product_modules(roots)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    where: dict[tuple[str, str], str] = {}
    unresolved: list[str] = []
    for module, path in mods.items():
        root = path.parents[len(module.split(".")) - 1 + (path.name == "__init__.py")]
        rel = path.relative_to(root.parent)  # e.g. packages/vllm_moonep/engine/buffer.py
        for target, line, name in imports_of(module, path, mods):
            if target is None:
                msg = f"{rel}:{line} imports {name}, which is no module of the tree"
                if msg not in unresolved:  # once per line, not per name imported from it
                    unresolved.append(msg)
            elif target != module:
                graph[module].add(target)
                where.setdefault((module, target), f"{rel}:{line}")
    return graph, where, unresolved


def circles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """``(component, circle)`` for each strongly connected component of more than one module (every
    module on some circle with the others), smallest first, with one shortest circle through it
    (``[a, b, ..., a]``). Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return [(c, _circle_in(graph, set(c))) for c in sorted(components, key=lambda c: (len(c), c))]


def _circle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first inside the component)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & comp):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no circle in component {sorted(comp)}")


def describe(circle: list[str], where: dict[tuple[str, str], str]) -> str:
    steps = [f"{a} -> {b} ({where[(a, b)]})" for a, b in zip(circle, circle[1:])]
    return "  " + "\n  ".join(steps)


# ---------------------------------------------------------------------------- tests
def test_product_modules_import_each_other_without_a_circle():
    """Import circles between the product's modules (lazy and TYPE_CHECKING imports included): the
    grouped-GEMM dispatcher and its implementations, the plugin's seams/hooks/runtime/cudagraphs,
    tools/ab.py and ab_vllm_poc.py imported each other."""
    graph, where, _ = import_graph(source_roots())
    assert len(graph) > 50, f"only {len(graph)} modules found: are the source roots right?"
    found = circles(graph)
    report = "\n".join(f"{len(comp)} modules on circles with each other: {', '.join(comp)}; one circle:\n"
                       f"{describe(circle, where)}" for comp, circle in found)
    assert not found, f"{len(found)} group(s) of modules that import each other:\n{report}"


def test_every_vllm_moonep_import_names_a_module_of_the_tree():
    """A module moved or renamed while an import of it (often a lazy one, which no import at load
    reaches) still named the old path."""
    _, _, unresolved = import_graph(source_roots())
    assert not unresolved, "\n".join(unresolved)


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> list[pathlib.Path]:
    for rel, text in files.items():
        p = tmp_path / "src" / NAMESPACE / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return [tmp_path / "src"]


SHAPES = {
    "package re-exporting its children": ({
        "pkg/__init__.py": "from vllm_moonep.pkg.a import A\nfrom .b import B\nfrom vllm_moonep.pkg import c\n",
        "pkg/a.py": "from vllm_moonep.pkg.b import B\n",
        "pkg/b.py": "B = 1\n",
        "pkg/c.py": "from . import b\n",
    }, None),
    "child importing its package back": ({
        "pkg/__init__.py": "from vllm_moonep.pkg.a import A\nX = 1\n",
        "pkg/a.py": "from vllm_moonep.pkg import X\nA = X\n",
    }, ["vllm_moonep.pkg", "vllm_moonep.pkg.a"]),
    "dispatcher and implementation (relative, lazy)": ({
        "gg/__init__.py": "",
        "gg/api.py": "from .impl import run\nclass Weights: ...\n",
        "gg/impl.py": "def run():\n    from .api import Weights\n    return Weights\n",
    }, ["vllm_moonep.gg.api", "vllm_moonep.gg.impl"]),
    "state in a module that imports its users (TYPE_CHECKING)": ({
        "plugin/__init__.py": "",
        "plugin/seams.py": "from vllm_moonep.plugin.hooks import LOAD\nclass SeamError(Exception): ...\n",
        "plugin/hooks.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from vllm_moonep.plugin.seams import SeamError\nLOAD = None\n"),
    }, ["vllm_moonep.plugin.hooks", "vllm_moonep.plugin.seams"]),
    "three modules through a lazy import_module": ({
        "t/__init__.py": "",
        "t/ab.py": "from vllm_moonep.t import poc\n",
        "t/poc.py": "from vllm_moonep.t.built import Built\n",
        "t/built.py": "def f():\n    import importlib\n    return importlib.import_module('vllm_moonep.t.ab')\n",
    }, ["vllm_moonep.t.ab", "vllm_moonep.t.built", "vllm_moonep.t.poc"]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_rule_on_small_trees(tmp_path, shape):
    """The rule missed a circle of a shape the product had (or called a package's re-exports one)."""
    files, expected = SHAPES[shape]
    graph, where, unresolved = import_graph(_tree(tmp_path, files))
    assert not unresolved, unresolved
    found = circles(graph)
    if expected is None:
        assert not found, found
    else:
        assert len(found) == 1 and found[0][0] == expected and sorted(set(found[0][1])) == expected, found
        describe(found[0][1], where)  # every edge of the circle names its import line


def test_an_import_of_a_missing_module_is_reported(tmp_path):
    """An import of a module that is not in the tree went unnoticed (lazily, nothing fails at load)."""
    roots = _tree(tmp_path, {"p/__init__.py": "", "p/a.py": "def f():\n    from vllm_moonep.p.gone import x\n"})
    _, _, unresolved = import_graph(roots)
    assert len(unresolved) == 1 and "vllm_moonep.p.gone" in unresolved[0] and "a.py:2" in unresolved[0], unresolved
