"""Keep CPU-resident weights resident under memory pressure: lock their pages (``mlock``).

Why: resident CPU weights are copies in the process's own memory (:mod:`loaders.checkpoint.materialize` says why
they are not views of the shards' maps); without swap the kernel cannot evict them, but with swap it can, and
decode then reads them back, token after token (one run under pressure fell from 5 tok/s to 0.25 when the weights
were evictable pages). Locked pages are never evicted or swapped.

How: :func:`lock_resident` locks every resident tensor's pages after the load with ``mlock2(MLOCK_ONFAULT)``,
which locks the pages already there and faults nothing in (the copies are all there already). The locks end when
the memory does (with the model's tensors). Disk-offloaded tensors are not locked: they are meant to be read from
the file.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from planner.hardware.device_inventory import host_memory
from planner.types import DeviceId

log = logging.getLogger(__name__)

#: Values of ``load_model(cpu_residency=...)``: ``lock`` locks resident CPU weights, ``map`` leaves them unlocked
#: (named when they were maps of the shards; they are private copies either way).
CPU_RESIDENCY_CHOICES = ("lock", "map")
PAGE = mmap.PAGESIZE

#: ``mlock2`` flag (linux/mman.h): lock the pages present (and any mapped in later), faulting none in.
MLOCK_ONFAULT = 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclass
class ResidencyStats:
    """What :func:`lock_resident` did, for ``load_stats``."""

    mode: str
    locked_bytes: int = 0
    seconds: float = 0.0
    #: Why nothing (or not everything) was locked; None when all went well.
    error: str | None = None


def drops_page_cache(copy_bytes: int, available: Callable[[], int] | None = None) -> bool:
    """Whether a load that copies ``copy_bytes`` of shards into private memory should drop the files' cached pages
    as it goes (``POSIX_FADV_DONTNEED``).

    Where the box could not hold the copies and the files' pages at once (less than twice ``copy_bytes`` free,
    a memory cgroup's limit counted), the pages go as soon as they are copied: page cache is reclaimable, but a
    cgroup near its limit reclaims under pressure, stalling the load. Elsewhere they stay: the next start of the
    server (an orchestrator's restart) then copies from the page cache instead of reading the disk again
    (0.43 s against 0.23 s for the 100M fp32 model's 0.4 GB on the benchmark VM, seconds for larger models).
    ``LOADMASTER_DROP_PAGE_CACHE=1`` always drops, ``0`` never does."""
    forced = os.environ.get("LOADMASTER_DROP_PAGE_CACHE", "")
    if forced in ("0", "1"):
        return forced == "1"
    if copy_bytes <= 0:
        return False
    free = available() if available is not None else host_memory().available
    return free < 2 * copy_bytes


def lock_pages(addr: int, nbytes: int) -> None:
    """Lock the pages of ``[addr, addr + nbytes)`` that are mapped, and those mapped later, without faulting any in.
    Raises :class:`OSError` where locking is refused (no ``CAP_IPC_LOCK``, ``ulimit -l`` too small)."""
    lo = addr - addr % PAGE
    hi = addr + nbytes
    if _libc.mlock2(lo, hi - lo, MLOCK_ONFAULT) != 0:
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


def lock_resident(model: torch.nn.Module, device_map: dict[str, DeviceId]) -> ResidencyStats:
    """Lock the pages of every CPU-resident tensor of ``model`` (see the module docstring). The locks live as long
    as the memory the tensors view."""
    t0 = time.perf_counter()
    stats = ResidencyStats("lock")
    tensors = resident_tensors(model, device_map)
    try:
        for _, t in tensors:
            nbytes = t.numel() * t.element_size()
            lock_pages(t.data_ptr(), nbytes)
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
