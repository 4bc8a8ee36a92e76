"""The house stays walkable: small folders, one name per module, functions and classes a reader can hold.

These are the layout's limits (``shared/design.md``): a folder of ``planner/``, ``loaders/`` or ``service/`` holds
at most 16 modules side by side, no two product modules share a file name (so a name says which one is meant), no
function is over 90 lines and no class over 300.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "loaders", "service")
MAX_MODULES_PER_FOLDER = 16
MAX_FUNCTION_LINES = 90
MAX_CLASS_LINES = 300
#: Names every package may have its own of: a package face, its exceptions, its plain records.
SHARED_NAMES = {"__init__.py", "__main__.py", "errors.py", "types.py"}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_folder_holds_more_than_16_modules():
    per_folder = Counter(p.parent for p in _modules() if p.name not in SHARED_NAMES - {"errors.py", "types.py"})
    crowded = {str(f.relative_to(ROOT)): n for f, n in per_folder.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"split these folders into subpackages by role: {crowded}"


def test_no_two_product_modules_share_a_file_name():
    by_name: dict[str, list[str]] = {}
    for p in _modules():
        if p.name not in SHARED_NAMES:
            by_name.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    twins = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not twins, f"name each module for what it holds: {twins}"


def test_functions_and_classes_fit_a_reader():
    long = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            size = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION_LINES:
                long.append(f"{p.relative_to(ROOT)}:{node.lineno} def {node.name}: {size} lines")
            elif isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                long.append(f"{p.relative_to(ROOT)}:{node.lineno} class {node.name}: {size} lines")
    assert not long, "split these into named steps:\n  " + "\n  ".join(long)
