"""Keep CPU-resident weights resident under memory pressure: lock their pages (``mlock``).

Why: resident CPU weights are views of the shards' memory maps (no copy at load). Those pages belong to the page
cache, which the kernel evicts first when memory runs short; decode then reads the weights from disk again, token
after token (one run under pressure fell from 5 tok/s to 0.25). Locked pages are never evicted.

How, without copying: the maps the tensors view are private (copy-on-write, so torch may wrap them), and locking a
writable private map would copy every page. So each shard is mapped a second time, shared and read-only, and the
byte ranges of the resident tensors are locked there: that pins the very page-cache pages the tensors read. Tensors
that are not views of a shard (converted dtypes, quantized weights) are locked where they are. Disk-offloaded
tensors are not locked: they are meant to be read from the file.

Locking needs ``CAP_IPC_LOCK`` or a large enough ``ulimit -l``; where it is refused, one warning says so and the
weights stay as they were (maps that the kernel may evict).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import time
import weakref
from dataclasses import dataclass

import torch

from planner.types import DeviceId

log = logging.getLogger(__name__)

#: Values of ``load_model(cpu_residency=...)``: ``lock`` pins resident CPU weights, ``map`` leaves them evictable.
CPU_RESIDENCY_CHOICES = ("lock", "map")
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class ResidencyStats:
    """What :func:`lock_resident` did, for ``load_stats``."""

    mode: str
    locked_bytes: int = 0
    seconds: float = 0.0
    #: Why nothing (or not everything) was locked; None when all went well.
    error: str | None = None


class _SharedMaps:
    """Read-only shared maps of shard files, unmapped (which unlocks them) when the model they serve is freed."""

    def __init__(self) -> None:
        self.maps: list[tuple[int, int]] = []  # (address, length)

    def map_file(self, path: str) -> int:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path}: {os.strerror(err)}")
        self.maps.append((addr, size))
        return addr

    def close(self) -> None:
        for addr, size in self.maps:
            _libc.munmap(addr, size)
        self.maps.clear()


def _mlock(addr: int, nbytes: int) -> None:
    lo = addr - addr % PAGE
    hi = addr + nbytes
    if _libc.mlock(lo, hi - lo) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _device_of(name: str, device_map: dict[str, DeviceId]) -> DeviceId | None:
    """The device of tensor ``name`` by the longest module prefix of the map that holds it."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    return None


def resident_tensors(model: torch.nn.Module, device_map: dict[str, DeviceId]) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (shared ones once) that the map places on the CPU, not on disk or a GPU."""
    out = []
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "cpu" or t.numel() == 0 or t.data_ptr() in seen:
            continue
        if _device_of(name, device_map) != "cpu":
            continue
        seen.add(t.data_ptr())
        out.append((name, t))
    return out


def lock_resident(
    model: torch.nn.Module, device_map: dict[str, DeviceId], shard_maps: dict[str, mmap.mmap], base_of
) -> ResidencyStats:
    """Lock the pages of every CPU-resident tensor of ``model`` (see the module docstring).

    ``shard_maps`` are the shard maps the tensors may view (path -> map) and ``base_of(path, map)`` their addresses.
    The locks live as long as ``model``."""
    t0 = time.perf_counter()
    stats = ResidencyStats("lock")
    tensors = resident_tensors(model, device_map)
    spans = {path: (base_of(path, mm), len(mm)) for path, mm in shard_maps.items()}
    shared = _SharedMaps()
    weakref.finalize(model, shared.close)
    shared_addr: dict[str, int] = {}
    try:
        for _, t in tensors:
            ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
            path = next((p for p, (base, size) in spans.items() if base <= ptr and ptr + nbytes <= base + size), None)
            if path is None:
                _mlock(ptr, nbytes)
            else:
                if path not in shared_addr:
                    shared_addr[path] = shared.map_file(path)
                _mlock(shared_addr[path] + (ptr - spans[path][0]), nbytes)
            stats.locked_bytes += nbytes
    except OSError as exc:
        stats.error = (
            f"could not lock the resident weights ({exc.strerror or exc}); they stay evictable under memory pressure. "
            "Run with CAP_IPC_LOCK or a larger `ulimit -l`, or pass cpu_residency='map' to skip locking."
        )
        log.warning("%s", stats.error)
    stats.seconds = time.perf_counter() - t0
    if stats.error is None and tensors:
        log.info("locked %.2f GiB of resident CPU weights in %.2fs", stats.locked_bytes / 2**30, stats.seconds)
    return stats
