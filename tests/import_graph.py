"""The project's import graph, read from source with ``ast``: every import counts, wherever it is written.

Function-local imports and imports under ``if TYPE_CHECKING:`` are edges like any other: an import placed inside a
function to dodge a cycle at start-up still ties the two modules together for a reader, and hiding a cycle is what
this graph exists to expose. Only imports of the project's own modules are kept.

``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` itself. Importing
``a.b.c`` is an edge to ``a.b.c`` only (not to the packages above it): a package's ``__init__`` running first is
Python's order of execution, not a dependency the importing module chose.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ImportEdge:
    """One import statement of one project module naming another project module."""

    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} (line {self.line})"


@dataclass
class ImportGraph:
    """Modules by dotted name (with the file each came from) and the imports among them."""

    files: dict[str, Path]
    edges: list[ImportEdge] = field(default_factory=list)

    def targets(self, module: str) -> set[str]:
        return {e.imported for e in self.edges if e.importer == module}

    def cycles(self) -> list[list[str]]:
        """One cycle (as a closed path ``a -> b -> ... -> a``) per strongly connected group of modules."""
        found = []
        for group in _strongly_connected(sorted(self.files), self.targets):
            start = min(group)
            if len(group) > 1 or start in self.targets(start):
                found.append(_path_within(start, set(group), self.targets))
        return sorted(found)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def build_graph(root: Path, packages: tuple[str, ...]) -> ImportGraph:
    """Parse every ``*.py`` under ``root/<package>`` for each of ``packages`` and collect their imports."""
    files = {module_name(root, path): path for package in packages for path in sorted((root / package).rglob("*.py"))}
    graph = ImportGraph(files)
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            for target in _imported_modules(node, name, is_package, files):
                graph.edges.append(ImportEdge(name, target, node.lineno))
    return graph


def _imported_modules(node: ast.AST, importer: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = []
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in known:
            targets.append(submodule)
        elif source in known:
            targets.append(source)
    return targets


def _strongly_connected(nodes: list[str], targets) -> list[list[str]]:
    """Tarjan's algorithm, iteratively (the graph is small, but recursion limits are not worth testing)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(targets(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(targets(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(sorted(group))
    return groups


def _path_within(start: str, group: set[str], targets) -> list[str]:
    """A shortest closed path from ``start`` back to itself through ``group`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(targets(node) & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")  # pragma: no cover
