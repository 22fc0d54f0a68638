"""The module-level import graph of tdfunc has no cycle.

Every ``.py`` file of the package is parsed (``ast``, nothing is imported): its imports that
run when the module is loaded (at module level, in ``if`` / ``try`` / ``with`` blocks and class
bodies; not inside functions, nor under ``if TYPE_CHECKING:``) become edges to the modules of
tdfunc they name. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg``. A package's parents (run first by Python) are not edges: the point is that
no two modules need each other to finish loading. Inside ``tdfunc.distributed`` imports
deferred into functions count too: there, the subpackages are layers, and a function-level
import must not hide a dependency that goes both ways.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "tdfunc"


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@functools.cache
def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module and package of tdfunc."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt], deferred: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body`` that run when the module is loaded (with
    ``deferred``: also those inside functions). ``if TYPE_CHECKING:`` blocks never run."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not deferred:
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse, deferred)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, []) or []:
                    if isinstance(child, (ast.excepthandler, ast.match_case)):
                        yield from _imports(child.body, deferred)
                    elif isinstance(child, ast.stmt):
                        yield from _imports([child], deferred)


def _edges(name: str, path: Path, modules: dict[str, Path], deferred: bool) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(_parse(path).body, deferred):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if not source.startswith(PACKAGE):
            continue
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in modules:
                out.add(sub)
            elif source in modules:
                out.add(source)
    out.discard(name)
    return out


@functools.cache
def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of tdfunc it imports when loaded (``deferred``: or later)."""
    modules = _modules()
    return {name: _edges(name, path, modules, deferred) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "tdfunc.distributed" in graph
    assert "tdfunc._deprecate" in graph["tdfunc.distributed"]
    assert len(graph) > 50


def test_module_level_imports_have_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_distributed_has_no_cycle_even_through_deferred_imports() -> None:
    """Inside ``tdfunc.distributed`` the jobs are layered (``_common`` <- ``_redistribute`` <-
    ``_transfer``; ``_checkpoint`` on ``_common``): an import inside a function does not hide a
    dependency that goes both ways either."""
    prefix = "tdfunc.distributed"
    graph = {
        name: {d for d in deps if d.startswith(prefix)}
        for name, deps in import_graph(deferred=True).items()
        if name.startswith(prefix)
    }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (counting deferred imports): " + " -> ".join(cycle or [])


def test_no_cycle_even_through_deferred_imports() -> None:
    """Nowhere in the package does an import inside a function hide a dependency that goes
    both ways (``memmap``'s leaf class and its pickling and writing helpers had one)."""
    cycle = find_cycle(import_graph(deferred=True))
    assert cycle is None, "import cycle (counting deferred imports): " + " -> ".join(cycle or [])


def test_no_module_imports_the_public_package() -> None:
    """Only ``tdfunc/__init__.py`` sits on top: no module imports a name from the public
    package (``from tdfunc import x``, ``from ... import x``), even inside a function; it
    imports the module that defines the name."""
    upward = sorted(
        name
        for name, deps in import_graph(deferred=True).items()
        if PACKAGE in deps and name != PACKAGE
    )
    assert upward == [], f"modules importing the public package {PACKAGE!r}: {upward}"


def test_the_checks_see_a_deferred_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The two checks above fail on a package that has a deferred cycle and an import of its
    public package (the graph reader, not only the search, is exercised)."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n    from .. import x\n")
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(pkg.rglob("*.py"))
    }
    graph = {n: _edges(n, p, modules, True) for n, p in modules.items()}
    assert find_cycle(graph) == ["tdfunc.sub.a", "tdfunc.sub.b", "tdfunc.sub.a"]
    assert PACKAGE in graph["tdfunc.sub.b"]
    assert find_cycle({n: _edges(n, p, modules, False) for n, p in modules.items()}) is None


def test_the_cycle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_distributed_shared_modules_import_no_job_package() -> None:
    """``tdfunc.distributed._common`` sits below the job subpackages (redistribute, transfer,
    checkpoint): it never imports them."""
    graph = import_graph()
    common = "tdfunc.distributed._common"
    for name, deps in graph.items():
        if name == common or name.startswith(common + "."):
            above = {d for d in deps if d.startswith("tdfunc.distributed.")}
            assert all(d.startswith(common) for d in above), (name, sorted(above))
