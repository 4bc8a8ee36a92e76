"""Cached, atomic build folders: a folder is either absent or a complete build of one recipe.

Model builds (the demo model, random-weight test and benchmark models) write into a temporary sibling folder and
finish by writing a marker (``loadmaster_build.json``) that records their recipe; the folder is then renamed into
place. A folder whose marker holds the same recipe is reused as it is, so callers may ask for a build freely, and two
processes asking at once both end up with the same complete folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER_NAME = "loadmaster_build.json"
BUILD_FORMAT = 2  # bump when builds change meaning, so cached folders are rebuilt
STALE_AFTER_S = 3600.0  # a temporary build folder this old belongs to a crashed build


def read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MARKER_NAME).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def is_complete(directory: Path, recipe: dict[str, Any]) -> bool:
    marker = read_marker(directory)
    return marker is not None and marker.get("recipe") == recipe


@contextmanager
def atomic_build_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir``; on success it is renamed into place, on failure removed.

    Builds write into the temporary folder and finish by writing the marker, so ``out_dir`` is either
    absent or complete. If another process finished first, its (identical) build is kept.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_leftovers(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        _make_shareable(tmp)
        _install(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_leftovers(out_dir: Path, max_age_s: float = STALE_AFTER_S) -> None:
    """Delete temporary folders that crashed builds of ``out_dir`` left behind long ago."""
    now = time.time()
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            try:
                if now - leftover.stat().st_mtime > max_age_s:
                    logger.info("removing stale build leftover %s", leftover)
                    shutil.rmtree(leftover, ignore_errors=True)
            except FileNotFoundError:
                pass


def _make_shareable(directory: Path) -> None:
    """Give the build ordinary permissions (mkdtemp and atomic shard writes use owner-only modes)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _install(tmp: Path, out_dir: Path) -> None:
    recipe = (read_marker(tmp) or {}).get("recipe")
    if out_dir.exists() and read_marker(out_dir) is not None and not is_complete(out_dir, recipe):
        # A stale build of ours with other arguments: move it aside, then replace it.
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, trash / "build")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)  # replaces a missing or empty folder atomically
    except OSError:
        if is_complete(out_dir, recipe):
            logger.info("another process finished %s first; keeping its build", out_dir)
            return
        raise


def check_target(out_dir: Path) -> None:
    """Refuse to overwrite a folder that holds something other than a build of ours."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and read_marker(out_dir) is None:
        raise FileExistsError(
            f"{out_dir} is not empty and was not built by loadmaster (no {MARKER_NAME}); "
            "choose an empty or new folder, or remove it first"
        )


def write_marker(directory: Path, recipe: dict[str, Any], **extra: Any) -> None:
    payload = {"format": BUILD_FORMAT, "recipe": recipe, **extra}
    (directory / MARKER_NAME).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
