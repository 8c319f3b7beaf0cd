"""The package's import graph: every module imports alone, and no two modules import each other.

A module that imports only after some other module was imported first (an import circle that the
usual import order happens to resolve) fails the first test; the second reads every import of the
package with Python's ast, those inside functions and under TYPE_CHECKING too (where circles hide
from the first test), and fails on any pair of modules that import each other, and on any circle
at all among the imports that run when a module is imported (module level).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pagedmlx

PACKAGE = Path(pagedmlx.__file__).resolve().parent


def module_files() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its __init__.py)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def imports_of(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module of the package, where: "module" | "function" | "type_checking", line)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: from the package, up level - 1 packages
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        # `from pagedmlx.kernels import build` imports the module pagedmlx.kernels.build
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "type_checking"
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((t, inner, child.lineno) for t in targets(child) if t in MODULES and t != name)
            visit(child, inner)

    visit(tree, "module")
    return found


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> ["where:line", ...]."""
    graph: dict[tuple[str, str], list[str]] = {}
    for name, path in MODULES.items():
        for target, where, line in imports_of(name, path):
            graph.setdefault((name, target), []).append(f"{where}:{line}")
    return graph


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in succ.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            strong(v)
    return out


def test_the_graph_reader_sees_function_level_type_checking_and_relative_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nfrom pagedmlx.kernels import build\n"
                    "if TYPE_CHECKING:\n    from pagedmlx.runner.model import ModelRunner\n"
                    "def f():\n    from . import selfcheck\n    import pagedmlx.core.kv.spec\n")
    got = {(t, w) for t, w, _ in imports_of("pagedmlx.runner.fake", path)}
    assert got == {("pagedmlx.kernels.build", "module"), ("pagedmlx.runner.model", "type_checking"),
                   ("pagedmlx.runner.selfcheck", "function"), ("pagedmlx.core.kv.spec", "function")}
    assert circles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]


def test_no_two_modules_import_each_other():
    """Wherever the imports stand: a circle closed inside a function still ties the two modules
    (core/kv/single_type.py <-> core/kv/state_manager.py and runner/model.py <-> runner/selfcheck.py were two)."""
    graph = import_graph()
    pairs = [f"{a} ({', '.join(graph[a, b])}) <-> {b} ({', '.join(graph[b, a])})"
             for a, b in sorted(graph) if a < b and (b, a) in graph]
    assert not pairs, "modules that import each other:\n" + "\n".join(pairs)


def test_no_circle_among_module_level_imports():
    module_level = {edge for edge, where in import_graph().items() if any(w.startswith("module") for w in where)}
    assert not circles(module_level)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """`python -c "import pagedmlx.x.y"` for each module, so that no module relies on another one
    having been imported before it (a circular import fails here with ImportError)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")

    def run(name: str) -> tuple[str, int, str]:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env,
                           cwd=PACKAGE.parent, timeout=300)
        return name, r.returncode, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        failed = [f"{name}: {err}" for name, code, err in pool.map(run, sorted(MODULES)) if code]
    assert not failed, "modules that do not import alone:\n" + "\n".join(failed)


def test_every_public_name_imports_from_the_package():
    """`from pagedmlx import LLM, SamplingParams, LLMEngine, ...`: each lazy export resolves to its class."""
    for name in pagedmlx.__all__:
        value = getattr(pagedmlx, name)
        assert name == "__version__" or getattr(value, "__name__", None) == name
