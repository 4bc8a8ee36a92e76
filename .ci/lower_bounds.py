"""Print the lower bound (``>=X``) pyproject.toml gives each named dependency, space-separated; exit 2 naming a
dependency that has none (the lower-bounds CI step then cannot test it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib


def lower_bound(name: str, dependencies: list[str]) -> str | None:
    for dep in dependencies:
        if re.match(rf"{re.escape(name)}\s*[<>=!~,]", dep) or dep.strip() == name:
            found = re.search(r">=\s*([0-9][\w.]*)", dep)
            return found.group(1) if found else None
    return None


def main(names: list[str]) -> int:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    bounds = [lower_bound(n, deps) for n in names]
    missing = [n for n, b in zip(names, bounds) if b is None]
    if missing:
        print(f"pyproject.toml gives no '>=' lower bound for {', '.join(missing)}", file=sys.stderr)
        return 2
    print(" ".join(b for b in bounds if b is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
