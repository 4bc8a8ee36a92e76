"""The project's imports point one way and never in a circle: service -> loaders -> planner, and nothing into tests;
inside each package, its subpackages too point one way (``service.http -> service.engine``, never back).

Every import counts, including the function-local ones that hide a cycle from Python at start-up
(see :mod:`tests.import_graph`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import ImportGraph, build_graph

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("planner", "loaders", "service", "bench", "tests")
#: Each layer may import only the layers after it (and itself).
LAYERS = ("service", "loaders", "planner")


#: Inside each package, its rooms from the top down: a module may import its own room or a room below it, never one
#: above. A room is a subpackage, or a module at the package's top level; "" is the package's face (``__init__``).
#: Rooms in one tuple stand on one floor (they may import each other, as long as no module cycle results).
ROOMS: dict[str, tuple[tuple[str, ...], ...]] = {
    "planner": (
        ("",),
        ("cluster",),
        ("api",),
        ("placement",),
        ("model",),
        ("hardware",),
        ("user_cache", "types", "errors"),
    ),
    "loaders": (("",), ("load", "pipeline_stage"), ("run",), ("native",), ("checkpoint",), ("errors",)),
    "service": (
        ("",),
        ("cli",),
        ("pipeline",),
        ("http",),
        ("schemas",),
        ("tools",),
        ("engine",),
        ("model",),
        ("ui",),
        ("settings",),
        ("errors",),
        ("log_text",),
    ),
}


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph(ROOT, PROJECT)


def test_the_graph_sees_every_package_and_its_imports(graph: ImportGraph):
    assert {_top(m) for m in graph.files} == set(PROJECT)
    assert "planner.types" in graph.targets("planner.api")
    assert "service.model.demo_model" in graph.targets("service.model.background_load")  # imported inside a function


def test_no_import_cycles_among_the_projects_modules(graph: ImportGraph):
    cycles = [" -> ".join(c) for c in graph.cycles()]
    assert not cycles, (
        "import cycles (function-local imports count): move the piece both sides need into a module of its own\n  "
        + "\n  ".join(cycles)
    )


def test_nothing_outside_tests_imports_from_tests(graph: ImportGraph):
    bad = [str(e) for e in graph.edges if _top(e.importer) != "tests" and _top(e.imported) == "tests"]
    assert not bad, (
        "only tests may import tests/; give the caller its own module or a package module:\n  " + "\n  ".join(bad)
    )


def test_layers_import_only_downwards(graph: ImportGraph):
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    bad = [
        str(e)
        for e in graph.edges
        if _top(e.importer) in rank and _top(e.imported) in rank and rank[_top(e.imported)] < rank[_top(e.importer)]
    ]
    assert not bad, "imports must point service -> loaders -> planner:\n  " + "\n  ".join(bad)


def test_every_room_of_every_package_is_named_in_the_order(graph: ImportGraph):
    unnamed = sorted(
        {f"{_top(m)}.{_room(m)}" for m in graph.files if _top(m) in ROOMS}
        - {f"{top}.{room}" for top, floors in ROOMS.items() for floor in floors for room in floor}
    )
    assert not unnamed, f"new rooms: give each its floor in ROOMS (tests/test_import_graph.py): {unnamed}"


def test_subpackages_import_only_downwards(graph: ImportGraph):
    floor = {(top, room): i for top, floors in ROOMS.items() for i, rooms in enumerate(floors) for room in rooms}
    bad = [
        str(e)
        for e in graph.edges
        if _top(e.importer) == _top(e.imported) in ROOMS
        and floor[(_top(e.imported), _room(e.imported))] < floor[(_top(e.importer), _room(e.importer))]
    ]
    assert not bad, (
        "an import runs back up between subpackages (e.g. service.engine -> service.http): move the piece both "
        "need down, or pass it in\n  " + "\n  ".join(bad)
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_hidden_in_a_function_and_relative_imports_are_found(tmp_path: Path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "def thing():\n    from . import c\n",
            "pkg/c.py": "if False:\n    import pkg.a\n",
            "pkg/d.py": "from pkg import a, missing\nimport os\n",
            "pkg/sub/__init__.py": "from .. import d\n",
            "pkg/selfish.py": "def f():\n    from pkg import selfish\n",
        },
    )
    graph = build_graph(tmp_path, ("pkg",))
    assert graph.targets("pkg.d") == {"pkg.a", "pkg"}
    assert graph.targets("pkg.sub") == {"pkg.d"}
    assert graph.cycles() == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.selfish", "pkg.selfish"]]


def test_an_acyclic_tree_has_no_cycles(tmp_path: Path):
    _write(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "from pkg import c\n", "pkg/c.py": ""},
    )
    assert build_graph(tmp_path, ("pkg",)).cycles() == []
