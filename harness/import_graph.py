"""The import graph of a source tree, read statically, and the cycles in it.

Every ``import`` and ``from ... import`` counts, at module level and inside
functions alike: a function-level import that closes a cycle still runs a
half-initialised module the first time the function is called. Only imports
under ``if TYPE_CHECKING:`` are left out, since they never run. A Cython
``.pyx`` module counts by its Python-level imports (its ``cimport`` lines are
resolved when it is compiled, not when it is imported).

An import counts as an edge to the module it names (``from pkg import name``:
to ``pkg.name`` when that is a module, else to ``pkg``), not to the packages
above it that Python imports first: those are already in ``sys.modules`` (half
initialised at worst) whenever one of their submodules runs, and a package
whose ``__init__`` imports a submodule would otherwise form a cycle with it.

Imports stdlib only, so it can run before anything else is imported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

_SOURCE_SUFFIXES = (".py", ".pyx")

# A Python-level import line of a .pyx file, with its parenthesised continuation.
_PYX_IMPORT = re.compile(
    r"^(?:from[ \t]+[\w.]+[ \t]+import[ \t]+(?:\([^)]*\)|[^\n]*)|import[ \t]+[^\n]*)", re.MULTILINE
)


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` (folders under ``root``) by dotted name."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*")):
            if path.suffix not in _SOURCE_SUFFIXES or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node``, skipping ``if TYPE_CHECKING:`` bodies (not their ``else``)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: list[ast.AST] = list(node.orelse)
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _import_nodes(child)


def module_level_imports(path: Path) -> set[str]:
    """The absolute modules a ``.py`` file imports when it is imported: its module-level
    statements and the ``if``/``try``/``with`` blocks among them, not function or class
    bodies, nor ``if TYPE_CHECKING:`` bodies (their ``else`` runs)."""
    names: set[str] = set()
    if path.suffix != ".py":
        return names
    todo: list[ast.stmt] = list(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif isinstance(node, ast.If):
            todo.extend(node.orelse if _is_type_checking(node.test) else [*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            todo.extend(
                [*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)]
            )
        elif isinstance(node, ast.With):
            todo.extend(node.body)
    return names


def third_party_imports(root: Path, packages: Iterable[str]) -> list[str]:
    """Every library a module of ``packages`` imports at module level, none of ``packages`` itself.

    A module reaches most of them through other modules of ours, so a check that imports
    one module with none of ours loaded first preloads all of them.
    """
    packages = tuple(packages)
    names: set[str] = set()
    for path in module_files(root, packages).values():
        names |= module_level_imports(path)
    # __future__ is a compiler directive, not a library.
    return sorted(name for name in names - {"__future__"} if name.split(".")[0] not in packages)


def _parse(path: Path) -> ast.Module:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":
        text = "\n".join(match.group(0) for match in _PYX_IMPORT.finditer(text))
    return ast.parse(text, filename=str(path))


def _package_of(module: str, path: Path) -> str:
    """The package a relative import in ``module`` starts from."""
    return module if path.stem == "__init__" else module.rpartition(".")[0]


def imported_modules(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (at ``path``) imports."""
    known = set(known)
    targets: set[str] = set()
    for node in _import_nodes(_parse(path)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            package = _package_of(module, path)
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        for alias in node.names:
            # "from pkg import name" runs pkg.name when it is a submodule, else pkg itself.
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in known else base)
    return {target for target in targets if target in known and target != module}


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Each module of ``packages`` under ``root`` -> the modules of those packages it imports."""
    modules = module_files(root, packages)
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: per strongly connected component of more than one
    module, shortest cycles through its members until each member is on one.

    A cycle is listed closed (its first module again at the end), so it reads as
    the chain of imports to break.
    """
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    # Tarjan's algorithm, iterative: a deep chain of imports must not hit the recursion limit.
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = lowlink[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    advanced = True
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    cycles: list[list[str]] = []
    for component in sorted(components):
        members = set(component)
        covered: set[str] = set()
        for start in component:
            if start not in covered:
                cycle = _cycle_through(graph, members, start)
                covered.update(cycle)
                cycles.append(cycle)
    return cycles


def _cycle_through(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest closed path from ``start`` within its component (breadth-first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for successor in sorted(graph[node] & component):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"not a cycle: {sorted(component)}")
