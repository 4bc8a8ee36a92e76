"""The test run's own caches: the suite never reads or writes the user's.

:func:`isolate` (called by tests/conftest.py before anything is collected) points every cache loadmaster and the
Hugging Face libraries use at a temporary folder for the run: ``XDG_CACHE_HOME`` (the root of loadmaster's caches:
calibration, offload folders, probes, import table), ``LOADMASTER_HOME`` (the demo model), ``HF_HOME`` (the Hub
cache), and the calibration is ``off``. The one exception is the built kernels: rebuilding them costs minutes on
two cores, so they live in the test cache beside the test models (``.cache/test-models/kernels``), never in the
user's ``~/.cache/loadmaster/kernels``. Variables that would move one cache back elsewhere are removed.

Subprocesses inherit this through ``os.environ``; an environment built from a filtered copy (dropping the
``LOADMASTER_`` variables, say) adds :func:`env` back. :func:`listing` and :func:`changes` compare the user's real
cache before and after the run (tests/conftest.py fails the run if it changed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

#: Set by :func:`isolate`; what :func:`env` hands to a subprocess environment built from a filtered copy.
VARIABLES = ("XDG_CACHE_HOME", "HF_HOME", "LOADMASTER_HOME", "LOADMASTER_CALIBRATION", "LOADMASTER_KERNEL_CACHE")
#: Removed by :func:`isolate`: each would move one cache outside the run's folder.
REMOVED = (
    "LOADMASTER_OFFLOAD_DIR",
    "LOADMASTER_IMPORT_CACHE_DIR",
    "HF_HUB_CACHE",
    "HF_XET_CACHE",
    "HF_ASSETS_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
)


def real_cache_root() -> Path:
    """The user's own ``$XDG_CACHE_HOME/loadmaster`` (``~/.cache/loadmaster``), as the environment says now."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loadmaster"


def isolate() -> Path:
    """Point every cache at a new temporary folder (returned; :func:`release` removes it)."""
    root = Path(tempfile.mkdtemp(prefix="loadmaster-tests-"))
    for var in REMOVED:
        os.environ.pop(var, None)
    os.environ.update(
        XDG_CACHE_HOME=str(root / "cache"),
        HF_HOME=str(root / "huggingface"),
        LOADMASTER_HOME=str(root / "loadmaster-home"),
        LOADMASTER_CALIBRATION="off",
    )
    from tests import models  # after the variables are set: it imports what reads them (huggingface_hub)

    os.environ["LOADMASTER_KERNEL_CACHE"] = str(models.cache_dir() / "kernels")
    return root


def release(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def env() -> dict[str, str]:
    """The isolating variables, for a subprocess environment built from a filtered copy of ``os.environ``."""
    return {k: os.environ[k] for k in VARIABLES if k in os.environ}


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``folder``: relative path -> (size, modification time in ns); {} if absent."""
    out: dict[str, tuple[int, int]] = {}
    if not folder.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            try:
                st = path.lstat()
            except OSError:  # removed while we walked
                continue
            out[str(path.relative_to(folder))] = (0 if name in dirnames else st.st_size, st.st_mtime_ns)
    return out


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """What differs between two listings, one line each: ``+ path`` (new), ``- path`` (gone), ``~ path`` (changed)."""
    lines = [f"+ {p}" for p in sorted(after.keys() - before.keys())]
    lines += [f"- {p}" for p in sorted(before.keys() - after.keys())]
    lines += [f"~ {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return lines
