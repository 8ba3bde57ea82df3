"""The package's import graph has no cycles: every import of a ``luka_bench`` module — top-level, inside a function
(lazy) or in an ``if TYPE_CHECKING:`` block (type-only) — read from the source, forms a directed graph without a
circle. (Only an ``if __name__ == "__main__":`` block is left out: it runs when the file is the program.)"""
from __future__ import annotations

import ast

from conftest import ROOT

PKG = ROOT / "luka_bench"


def _module(path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _main_block(node) -> bool:
    """``if __name__ == "__main__":`` runs when the file is the program (a module of another name): that block does
    not make the module depend on what it imports. A ``TYPE_CHECKING`` block does: it counts."""
    t = node.test
    return isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"


def import_graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        graph[mod] = _imports(ast.parse(path.read_text(encoding="utf-8")), pkg, set(modules)) - {mod}
    return graph


def _imports(tree, pkg: str, modules: set[str]) -> set[str]:
    """The package modules a module's source imports (``pkg``: its package, for relative imports)."""
    out: set[str] = set()
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _main_block(node)
            for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in modules:
                n = n.rsplit(".", 1)[0] if "." in n else ""
            if n and n != "luka_bench":  # the package's own __init__ is the lazy public API
                out.add(n)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_type_only_and_lazy_imports_count():
    """The graph sees an import made only for types and one made inside a function."""
    import textwrap

    src = textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from luka_bench.methods.cache import MethodCache
        def f():
            from luka_bench.methods import hf
        if __name__ == "__main__":
            from luka_bench import run
    """)
    found = _imports(ast.parse(src), "luka_bench.methods", {"luka_bench.methods.cache", "luka_bench.methods.hf",
                                                            "luka_bench.run"})
    assert found == {"luka_bench.methods.cache", "luka_bench.methods.hf"}
