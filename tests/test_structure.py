"""The package's structure as docs/design.md states it: one door to the native code, no import circles.

Read from the sources with ``ast`` (nothing is imported): every ``import`` of a ktquest module, at any depth of
a file (a function's lazy import closes a circle as well as a module-level one), except those under
``if TYPE_CHECKING:``, which only type checkers follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ktquest"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """The modules (ktquest.* only) this file imports outside ``if TYPE_CHECKING:`` blocks."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for n in child.orelse:
                    visit(n)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the file's package up
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in child.names)  # `from pkg import module`
            visit(child)

    visit(tree)
    return {m for m in out if m == "ktquest" or m.startswith("ktquest.")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py")
        # `from ktquest.x import y`: y is a module where such a file exists, else a name in ktquest.x
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circle_in_the_package():
    graph = _graph()
    # A package imported by its own modules is not a circle of ours: `ktquest` -> `ktquest.x` only through
    # `ktquest.load`'s lazy import of the engine, and the modules import `ktquest` for `_C` / `__version__`.
    for deps in graph.values():
        deps.discard("ktquest")
    assert _cycles(graph) == []


def test_the_circle_finder_finds_one():
    """The check above can fail: a lazy import back from b to a is a circle."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ktquest.b\ndef f():\n    import ktquest.c\n"
    assert _imports(ast.parse(src), "ktquest.a", False) == {"ktquest.c"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_native_package_imports_the_extension(path):
    """``ktquest/native/`` is the one door to ``_C``: nothing else imports it or names it."""
    if path.relative_to(PACKAGE).parts[0] == "native":
        return
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "_C" for a in node.names):
            bad.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_C"):
            bad.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.endswith("._C") for a in node.names):
            bad.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "_C":
            bad.append(node.lineno)
    assert bad == [], f"{path.relative_to(PACKAGE.parent)} reaches ktquest._C at lines {bad}"
