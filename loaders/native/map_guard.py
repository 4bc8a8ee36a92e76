"""A guard on the shard maps the disk tier reads in place: a shard truncated under a running server becomes an
error the server reports, not a SIGBUS that kills it without a word.

Why a guard and not reads: on a host without GPUs the disk tier's weights are views of the shards' memory maps,
read by the kernels where they lie (no copy per token, the page cache shared with every other reader); a copy
per token into a buffer would cost the disk tier a memcpy of every weight it reads. But a mapped page past a
file's end (the file was truncated) raises SIGBUS when it is read, and SIGBUS kills the process: no log line, no
503, the client sees a dropped connection. ``kernels/map_guard.c`` installs a SIGBUS handler that, for a fault in
a guarded map, maps zero pages over the rest of that map and counts the fault; the step finishes on zeros, and
:func:`check` (called after every step by the engine) raises :class:`~loaders.errors.WeightsChangedError`, so
that step's answers are never sent. A fault outside the guarded maps goes to the handler installed before
(Python's ``faulthandler``, or the default: the process dies as it would have).

Built once with the system C compiler into the kernels' cache (:func:`build`, which the Docker image's build
stage runs) and loaded from a private in-memory copy. Where it cannot be built, one warning says so and the maps
are unguarded, as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import subprocess
import threading
import weakref
from pathlib import Path

from loaders.errors import WeightsChangedError
from loaders.native.kernel_build import KERNEL_DIR, _compiler, _compiler_identity, cache_dir
from planner.user_cache import replace_atomically

log = logging.getLogger(__name__)

SOURCE = KERNEL_DIR / "map_guard.c"
CFLAGS = ("-O2", "-shared", "-fPIC")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": ctypes.CDLL or None, "why": the reason it is None
_guarded: dict[int, int] = {}  # id(map) -> its address, while guarded


def _stem(cc: str) -> str:
    h = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + _compiler_identity(cc).encode())
    return f"map-guard-{h.hexdigest()[:16]}"


def build(cc: str | None = None) -> Path:
    """The guard's library in the kernels' cache, compiled unless it is there. Raises ``RuntimeError`` without a
    compiler or when the compile fails."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH to build the SIGBUS guard of the shard maps")
    target = cache_dir() / f"{_stem(cc)}.so"
    if target.is_file():
        return target

    def compile_to(tmp: str) -> None:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {proc.stderr.strip()[-500:]}")

    replace_atomically(target, compile_to, mode=0o755)
    return target


def _private_copy(path: Path) -> ctypes.CDLL:
    """Loaded from a memfd copy, so that the cache file can change under the process without a SIGBUS of its own."""
    image = path.read_bytes()
    try:
        fd = os.memfd_create(f"loadmaster-{path.name}")
    except (AttributeError, OSError):
        return ctypes.CDLL(str(path))
    view = memoryview(image)
    while view:
        view = view[os.write(fd, view) :]
    return ctypes.CDLL(f"/proc/self/fd/{fd}")  # the descriptor stays open: the library is loaded by that name


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            try:
                lib = _private_copy(build())
                lib.lm_guard_add.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                lib.lm_guard_remove.argtypes = [ctypes.c_void_p]
                lib.lm_guard_faults.restype = ctypes.c_long
                lib.lm_guard_faults_at.argtypes = [ctypes.c_void_p]
                lib.lm_guard_faults_at.restype = ctypes.c_long
                if lib.lm_guard_install() != 0:
                    raise OSError("sigaction(SIGBUS) failed")
                _state["lib"] = lib
            except (RuntimeError, OSError) as exc:
                _state["lib"], _state["why"] = None, str(exc)
                log.warning(
                    "the shard maps read in place are not guarded (%s): a shard truncated while serving kills the "
                    "server with SIGBUS instead of failing its requests",
                    exc,
                )
        return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether maps can be guarded here (builds and installs the guard on first call)."""
    return _library() is not None


def guard(mm: mmap.mmap) -> bool:
    """Guard ``mm`` until it is closed: a read past its file's end becomes zeros and a counted fault, not SIGBUS.
    False where the guard is not available (or its table is full)."""
    lib = _library()
    if lib is None or len(mm) == 0:
        return lib is not None
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    with _lock:
        if id(mm) in _guarded:
            return True
        if lib.lm_guard_add(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm))) != 0:
            log.warning("the SIGBUS guard's table is full; %d more bytes of shard maps are not guarded", len(mm))
            return False
        _guarded[id(mm)] = addr
    weakref.finalize(mm, _unguard, id(mm), addr)
    return True


def _unguard(key: int, addr: int) -> None:
    lib = _state.get("lib")
    with _lock:
        if _guarded.pop(key, None) is not None and lib is not None:
            lib.lm_guard_remove(ctypes.c_void_p(addr))  # type: ignore[union-attr]


def _faults_by_file(model: object) -> dict[str, int]:
    lib = _state.get("lib")
    reader = getattr(model, "_loadmaster_reader", None)
    if not lib or reader is None:
        return {}
    with _lock:
        addrs = {path: _guarded[id(mm)] for path, mm in list(reader.maps.items()) if id(mm) in _guarded}
    return {path: max(0, lib.lm_guard_faults_at(ctypes.c_void_p(a))) for path, a in addrs.items()}  # type: ignore[union-attr]


def faults(model: object) -> int:
    """Reads of ``model``'s guarded shard maps found past their file's end so far (0 until one is truncated)."""
    return sum(_faults_by_file(model).values())


def truncated_files(model: object) -> list[str]:
    """The files of ``model``'s guarded maps that a read found shorter than when they were mapped."""
    return sorted(path for path, n in _faults_by_file(model).items() if n)


def check(model: object) -> None:
    """Raise :class:`~loaders.errors.WeightsChangedError` once one of ``model``'s guarded maps has been read past
    its file's end: the weights that step read were zeros, not the model's."""
    lost = truncated_files(model)
    if lost:
        names = ", ".join(Path(p).name for p in lost)
        raise WeightsChangedError(
            f"{names}, read in place by the disk tier, was truncated while the server ran, so this step read "
            "zeros instead of weights and its answers are discarded. The server stops serving; restart it on "
            "the complete files."
        )


__all__ = ["available", "build", "check", "faults", "guard", "truncated_files"]
