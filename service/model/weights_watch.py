"""The served weights' files, watched: a shard truncated, removed or rewritten (in place or by rename) under a
running server no longer holds what the server loaded. Resident weights are private copies and stay as loaded,
but the disk tier reads the files in place (a rewrite changes its answers; a truncation is caught by
:mod:`loaders.native.map_guard`), and a restart would load the new files: the server stops rather than serve a mix.

:class:`WeightsWatch` records each weight file's size, inode and mtime at ready, and checks them every
``--weights-watch-interval`` seconds on a thread of its own, and whether :mod:`loaders.native.map_guard` caught a
read past a truncated shard's end (the disk tier reads shards in place). On a change it calls ``on_change(reason)`` once; the
runtime then stops admitting (503 with the reason), ends what is in flight with that error, and the server exits
non-zero so that its orchestrator restarts it on the new files.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from loaders.native import map_guard

log = logging.getLogger(__name__)

#: The files whose bytes the served model reads (its shards); configs and tokenizers are read once, at load.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns


def weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


class WeightsWatch:
    """Stat the weight files every ``interval`` seconds; call ``on_change`` with the first difference found."""

    def __init__(self, files: list[Path], interval: float, on_change: Callable[[str], None], model: object = None):
        self.files = files
        #: The served model, whose disk-tier maps :mod:`loaders.native.map_guard` guards.
        self.model = model
        self.interval = interval
        self.on_change = on_change
        self.seen = {p: _identity(p) for p in files}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loadmaster-weights-watch", daemon=True)

    def start(self) -> WeightsWatch:
        if self.files and self.interval > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """What changed, in words; ``None`` while every file is as it was."""
        lost = map_guard.truncated_files(self.model)  # a step already read past a shard's end (before a stat saw it)
        if lost:
            return f"{Path(lost[0]).name} was truncated (a step read past its end)"
        for path, was in self.seen.items():
            now = _identity(path)
            if now == was:
                continue
            if now is None:
                return f"{path.name} was removed"
            if was is not None and now[0] != was[0]:
                return f"{path.name} changed size from {was[0]} to {now[0]} bytes"
            if was is not None and now[1:3] != was[1:3]:
                return f"{path.name} was replaced by another file"
            return f"{path.name} was rewritten (its modification time changed)"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            reason = self.check()
            if reason is not None:
                log.error("the served model's weights changed on disk: %s", reason)
                self.on_change(reason)
                return
