"""Where loadmaster keeps what it reuses between runs (built kernels, the calibration, offload folders, probe
answers, transformers' import table): under one root, ``$XDG_CACHE_HOME/loadmaster`` (``~/.cache/loadmaster``),
so that one variable moves them all, and each can be moved on its own by the variable that names it."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path


def user_cache_path(name: str, override_var: str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """``$override_var`` when it is set and not empty, else ``$XDG_CACHE_HOME/loadmaster/name`` (``~/.cache`` when
    that is unset or empty)."""
    env = os.environ if environ is None else environ
    override = env.get(override_var, "") if override_var else ""
    if override:
        return Path(override).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loadmaster" / name


def default_offload_folder(model_path: Path) -> Path:
    """Where converted disk tensors go when the caller names no folder: a per-model cache directory (here, below
    the loaders, so that ``loadmaster plan`` finds it without importing torch)."""
    base = user_cache_path("offload", "LOADMASTER_OFFLOAD_DIR")
    digest = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:16]
    return base / f"{model_path.resolve().name}-{digest}"


def replace_atomically(target: Path, write: Callable[[str], object], mode: int = 0o644) -> None:
    """Have ``write(tmp)`` fill a temporary sibling of ``target``, then rename it into place, so that readers (other
    processes starting at the same time included) see the old file or the whole new one, never part of one. Creates
    the folder. ``mode``: the file's permissions (a temporary file starts private; a cache an image builds for its
    runtime user must be readable, a library executable)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomically(target: Path, text: str, mode: int = 0o644) -> None:
    """:func:`replace_atomically` with ``text`` as the file's content, flushed to the disk before the rename."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    replace_atomically(target, write, mode)
