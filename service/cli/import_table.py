"""transformers' lazy-import table, read from the user's cache instead of rebuilt from its sources at every start.

Why: ``import transformers`` builds the table its lazy modules answer from by reading every source file under
``transformers/models`` (1,686 files in 5.x) and parsing each one's ``__all__`` and ``@requires`` lines, about a
quarter of a second on a 2-core machine. It does it twice per process: the package and its ``models`` subpackage each
ask for the same folder, and the per-folder ``lru_cache`` meant to share the work holds 128 folders of the 567, so
the second walk finds none of the first. That is half a second of a server's ~3 s start, spent on a result that only
changes when transformers' files do.

:func:`install` (before anything imports transformers) watches for ``transformers.utils.import_utils`` to load and
then wraps its folder scan (``create_import_structure_from_path``, looked up by name at each call, recursive calls
included):

- every folder's table is kept for the life of the process (so the second walk costs nothing);
- the outermost folder's table is also written to ``$XDG_CACHE_HOME/loadmaster/import-structure/`` as JSON
  (never pickle), with a fingerprint of the folder: the path, size and modification time of every file under it, and
  of ``import_utils.py`` itself (the parser). A later process that finds the same fingerprint reads the table back
  (~25 ms to fingerprint, a few to read) instead of parsing the sources.

The table is a pure function of the files read, so a fingerprint match gives the same table. Anything unexpected (a
transformers whose scan is named or shaped otherwise, a table holding types other than folders, backend sets and
module names, an unreadable or unwritable cache) leaves transformers' own scan in charge for that call, with a debug
log line. ``LOADMASTER_IMPORT_CACHE=0`` turns it all off.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from planner.user_cache import user_cache_path, write_text_atomically

log = logging.getLogger(__name__)

#: The module whose folder scan is wrapped, and the scan's name in it.
TARGET_MODULE = "transformers.utils.import_utils"
SCAN_NAME = "create_import_structure_from_path"
#: Bump when the cache file's layout changes.
CACHE_FORMAT = 1

#: A folder's table: sub-folder name -> its table, or a backend set -> {module name: exported names}.
Table = dict[Any, Any]


def cache_dir() -> Path:
    """``$LOADMASTER_IMPORT_CACHE_DIR``, else ``$XDG_CACHE_HOME/loadmaster/import-structure``."""
    return user_cache_path("import-structure", "LOADMASTER_IMPORT_CACHE_DIR")


def install() -> bool:
    """Wrap transformers' folder scan when its module loads; returns whether the watch was set up.

    Does nothing when transformers is already imported (its table is built by then), when turned off by
    ``LOADMASTER_IMPORT_CACHE=0``, or when already installed."""
    if os.environ.get("LOADMASTER_IMPORT_CACHE") == "0":
        return False
    if TARGET_MODULE in sys.modules or any(isinstance(f, _ScanWatcher) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _ScanWatcher())
    return True


def uninstall() -> None:
    """Stop watching for transformers' import (a module already wrapped stays wrapped)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ScanWatcher)]


class _ScanWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when the target module is about to load, hands back its real spec with a loader that
    wraps the scan right after the module runs, then stops watching."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != TARGET_MODULE:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _WrappingLoader(spec.loader)
        return spec


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        wrap_scan(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... as the real loader answers them
        return getattr(self.inner, name)


def wrap_scan(module: ModuleType) -> bool:
    """Replace ``module``'s folder scan by a :class:`CachedScan` of it; returns whether it did."""
    scan = getattr(module, SCAN_NAME, None)
    if not callable(scan) or isinstance(scan, CachedScan):
        log.debug("transformers has no %s to cache; its own scan runs", SCAN_NAME)
        return False
    parser_file = getattr(module, "__file__", None)
    setattr(module, SCAN_NAME, CachedScan(getattr(scan, "__wrapped__", scan), parser_file))
    return True


class CachedScan:
    """transformers' folder scan, each folder's table kept for the process and the outermost one on disk."""

    def __init__(self, scan: Callable[[Any], Table], parser_file: str | None):
        self.scan = scan
        self.parser_file = parser_file
        self.tables: dict[str, Table] = {}
        #: Folders transformers' own scan read (sources parsed), and outermost tables read back from the cache.
        self.scanned = 0
        self.read_back = 0
        self._depth = 0  # calls of the scan under way (it recurses into sub-folders through this wrapper)
        self.lock = threading.RLock()

    def __call__(self, module_path: Any) -> Table:
        folder = os.fspath(module_path)
        if os.path.isfile(folder):  # as the scan itself does: a file stands for its folder
            folder = os.path.dirname(folder)
        with self.lock:  # one thread's scan at a time (its recursion re-enters)
            table = self.tables.get(folder)
            if table is not None:
                return table
            # the files as they are before any scan: a file changed while it runs makes the next start scan again
            fingerprint = self._fingerprint(folder) if self._depth == 0 else None
            table = self._read(folder, fingerprint) if fingerprint else None
            if table is not None:
                self._keep_subfolders(folder, table)
            else:
                self._depth += 1
                self.scanned += 1
                try:
                    table = self.scan(folder)
                finally:
                    self._depth -= 1
                if fingerprint:
                    self._write(folder, table, fingerprint)
            self.tables[folder] = table
            return table

    def _keep_subfolders(self, folder: str, table: Table) -> None:
        """Keep the tables of a read-back table's sub-folders too (a model's own package asks for its folder)."""
        for key, value in table.items():
            if isinstance(key, str):
                sub = os.path.join(folder, key)
                self.tables.setdefault(sub, value)
                self._keep_subfolders(sub, value)

    def _fingerprint(self, folder: str) -> str | None:
        """A digest of the path, size and modification time of every file the scan can read, and of its parser;
        None where they cannot all be listed (the scan then runs, uncached, and says what is wrong)."""
        try:
            return self._digest(folder)
        except OSError as exc:
            log.debug("transformers' import table for %s not cached (%s)", folder, exc)
            return None

    def _digest(self, folder: str) -> str:
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"{CACHE_FORMAT}\0{folder}\0".encode())
        if self.parser_file:
            st = os.stat(self.parser_file)
            digest.update(f"{self.parser_file}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        pending = [folder]
        while pending:
            with os.scandir(pending.pop()) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    if entry.name == "__pycache__":
                        continue
                    if entry.is_dir():
                        pending.append(entry.path)
                        continue
                    st = entry.stat()
                    digest.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        return digest.hexdigest()

    def _file(self, folder: str) -> Path:
        return cache_dir() / (hashlib.blake2b(folder.encode(), digest_size=12).hexdigest() + ".json")

    def _read(self, folder: str, fingerprint: str) -> Table | None:
        try:
            stored = json.loads(self._file(folder).read_text(encoding="utf-8"))
            if stored.get("fingerprint") != fingerprint:
                return None
            table = _decode(stored["table"])
            self.read_back += 1
            return table
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("transformers' import table cache for %s unreadable (%s); scanning", folder, exc)
            return None

    def _write(self, folder: str, table: Table, fingerprint: str) -> None:
        try:
            body = json.dumps({"fingerprint": fingerprint, "table": _encode(table)})
            write_text_atomically(self._file(folder), body)
        except (OSError, TypeError) as exc:
            log.debug("transformers' import table for %s not cached (%s)", folder, exc)


def _encode(table: Table) -> list[Any]:
    """A table as JSON-able entries, in order: ``["dir", name, entries]`` or ``["mod", backends, {module: names}]``."""
    out: list[Any] = []
    for key, value in table.items():
        if isinstance(key, str) and isinstance(value, dict):
            out.append(["dir", key, _encode(value)])
        elif isinstance(key, frozenset) and isinstance(value, dict):
            modules = {}
            for module, names in value.items():
                if not isinstance(module, str) or not isinstance(names, set):
                    raise TypeError(f"unexpected module entry {module!r}: {type(names).__name__}")
                modules[module] = sorted(names)
            out.append(["mod", sorted(key), modules])
        else:
            raise TypeError(f"unexpected table entry {key!r}: {type(value).__name__}")
    return out


def _decode(entries: list[Any]) -> Table:
    table: Table = {}
    for kind, key, value in entries:
        if kind == "dir":
            table[key] = _decode(value)
        elif kind == "mod":
            table[frozenset(key)] = {module: set(names) for module, names in value.items()}
        else:
            raise ValueError(f"unknown entry kind {kind!r}")
    return table
