"""Where loadmaster keeps what it reuses between runs (built kernels, the calibration, offload folders, probe
answers, transformers' import table): under one root, ``$XDG_CACHE_HOME/loadmaster`` (``~/.cache/loadmaster``),
so that one variable moves them all, and each can be moved on its own by the variable that names it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def user_cache_path(name: str, override_var: str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """``$override_var`` when it is set and not empty, else ``$XDG_CACHE_HOME/loadmaster/name`` (``~/.cache`` when
    that is unset or empty)."""
    env = os.environ if environ is None else environ
    override = env.get(override_var, "") if override_var else ""
    if override:
        return Path(override).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loadmaster" / name
