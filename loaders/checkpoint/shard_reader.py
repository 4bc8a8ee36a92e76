"""Reading tensor bytes out of safetensors shards: straight into a destination, or as a zero-copy memory map.

``read_into`` uses positioned reads (``os.preadv``) into a destination's own memory: every resident tensor
(CPU or GPU), so that what the process holds is its own and a file changed on disk cannot reach it, and a file
that ends early is an error, not a signal. ``mapped`` returns a tensor backed by a private, copy-on-write memory
map of the shard, no copy at all: that is how ``"disk"`` tensors are served on a host without GPUs when no cast
is needed (left to fault in as the model reads them; :mod:`loaders.native.map_guard` turns a read past a truncated
file's end into an error instead of SIGBUS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

import torch

from loaders.checkpoint.index import ShardEntry
from loaders.errors import WeightsChangedError

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux >= 5.14: map a file range's pages (reading them if needed) in one call
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in with one call instead of one fault per page
_POPULATE_MIN = 1 << 20
#: Bytes copied between two drops of the file's cached pages (``read_into(drop_cache=True)``).
DROP_CHUNK = 32 << 20
_libc = None


def _get_libc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    return _libc


def populate(t: torch.Tensor) -> None:
    """Pre-fault a fresh CPU tensor's pages in one madvise call before reading into it (best effort).

    Page faults, not copying, dominate reads from a warm page cache into fresh memory (~10x on this project's
    VMs); batching them in the kernel saves ~10-15% of a load. Errors (older kernels) are ignored.
    """
    nbytes = t.numel() * t.element_size()
    libc = _get_libc()
    if nbytes < _POPULATE_MIN or t.device.type != "cpu" or not libc:
        return
    lo = t.data_ptr() & ~(PAGE - 1)
    hi = (t.data_ptr() + nbytes + PAGE - 1) & ~(PAGE - 1)
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_POPULATE_WRITE)


def _drop_cached(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to drop the file's cached pages of a range just copied (best effort: whole pages only, and a
    page another process maps stays)."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor of any dtype (bf16 included, which numpy lacks)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(flat.view(torch.uint8).numpy())


class ShardReader:
    """Open file descriptors and memory maps for a checkpoint's shards; safe to use from several threads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._addrs: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                self._fds[path] = fd
            return fd

    def read_into(self, entry: ShardEntry, dest: torch.Tensor, drop_cache: bool = False) -> int:
        """Fill ``dest`` (CPU, contiguous, the entry's dtype and numel) with the entry's bytes. Returns bytes read.

        A file that ends early (truncated under the process) raises :class:`WeightsChangedError` (a
        :class:`CheckpointError`): a read reports a short file, where a map would raise SIGBUS. ``drop_cache``: drop the file's page-cache pages of each
        :data:`DROP_CHUNK` once it is copied (``POSIX_FADV_DONTNEED``), so that a private copy never holds the
        file's pages and its own at once beyond one chunk (a box barely larger than the weights)."""
        if dest.dtype != entry.dtype or dest.numel() != entry.numel or not dest.is_contiguous():
            raise ValueError(f"read_into needs a contiguous {entry.dtype} destination of {entry.numel} elements")
        view = byte_view(dest)
        fd = self._fd(entry.file)
        done, total = 0, entry.nbytes
        step = DROP_CHUNK if drop_cache else total
        while done < total:
            stop = min(total, done + step)
            chunk_start = done
            while done < stop:
                n = os.preadv(fd, [view[done:stop]], entry.start + done)
                if n <= 0:  # at load, or while streaming the disk tier to a GPU
                    raise WeightsChangedError(
                        f"{entry.file} ended while reading {entry.key!r} (got {done} of {total} bytes): the shard "
                        "was truncated or replaced while it was read. Re-download or re-save it, then restart."
                    )
                done += n
            if drop_cache:
                _drop_cached(fd, entry.start + chunk_start, done - chunk_start)
        return total

    def drop_cached(self, path: str, start: int, end: int) -> None:
        """Drop the page-cache pages of ``[start, end)`` of a shard whose bytes were copied (best effort)."""
        _drop_cached(self._fd(path), start, end - start)

    def read(self, entry: ShardEntry) -> torch.Tensor:
        """A fresh CPU tensor holding the entry, in its stored dtype."""
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(entry, out)
        return out

    def mapping(self, path: str) -> mmap.mmap:
        with self._lock:
            mm = self._maps.get(path)
            if mm is None:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._maps[path] = mm
            return mm

    def mapped(self, entry: ShardEntry) -> torch.Tensor:
        """A tensor that reads the entry's bytes from the shard's memory map: no copy, no RSS until touched."""
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        mm = self.mapping(entry.file)
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        if entry.start % itemsize:
            # Misaligned for its dtype (odd-sized tensors before it): the map cannot be viewed safely, so copy.
            return self.read(entry)
        t = torch.frombuffer(mm, dtype=entry.dtype, count=entry.numel, offset=entry.start)
        return t.view(entry.shape)

    def read_mapped_into(self, src: torch.Tensor, dest: torch.Tensor) -> bool:
        """Fill ``dest`` with the bytes of ``src``, a contiguous tensor mapped from one of these shards, by positioned
        reads of the file rather than by touching the map: no page faults (one per 4 KiB page, each mapping a page
        into this process), and the reads release the GIL. False, with nothing read, when ``src`` is not such a
        view or ``dest`` is not a contiguous CPU tensor of the same bytes."""
        nbytes = src.numel() * src.element_size()
        if (
            nbytes == 0
            or not src.is_contiguous()
            or not dest.is_contiguous()
            or dest.device.type != "cpu"
            or dest.numel() * dest.element_size() != nbytes
        ):
            return False
        ptr = src.data_ptr()
        with self._lock:
            maps = list(self._maps.items())
        for path, mm in maps:
            base = self._base(path, mm)
            if base <= ptr and ptr + nbytes <= base + len(mm):
                start = ptr - base
                entry = ShardEntry("", path, torch.uint8, (nbytes,), start, start + nbytes)
                self.read_into(entry, dest.reshape(-1).view(torch.uint8))
                return True
        return False

    def _base(self, path: str, mm: mmap.mmap) -> int:
        with self._lock:
            base = self._addrs.get(path)
            if base is None:
                base = self._addrs[path] = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            return base

    def range_of(self, t: torch.Tensor) -> tuple[str, int, int] | None:
        """``(path, start, end)``: the bytes of one of these maps that contiguous ``t`` views; None if it views none
        (a copy in the process's own memory)."""
        addr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for path, mm in list(self._maps.items()):
            base = self._base(path, mm)
            if base <= addr and addr + nbytes <= base + len(mm):
                return path, addr - base, addr - base + nbytes
        return None

    def is_cached(self, path: str, start: int, end: int, samples: int = 8) -> bool:
        """Whether ``samples`` evenly spaced pages of ``[start, end)`` of a mapped shard are in the page cache.

        A probe, not a census: one ``mincore`` per sampled page costs microseconds, where ``MADV_WILLNEED`` on a
        warm 90 MB block costs ~0.3 ms (it looks up every page) and ``mincore`` over all of it more. Readahead
        asks this first and skips the advice when the block is cached; eviction (whole LRU runs of pages) shows
        in the samples. ``False`` when it cannot tell.
        """
        mm = self._maps.get(path)
        libc = _get_libc()
        if mm is None or not libc:
            return False
        lo = (start // PAGE) * PAGE
        hi = min(len(mm), end)
        if hi <= lo:
            return True
        base = self._base(path, mm)
        npages = (hi - lo + PAGE - 1) // PAGE
        step = max(1, npages // samples)
        vec = (ctypes.c_ubyte * 1)()  # mincore's answer for one page
        for i in range(0, npages, step):
            if libc.mincore(ctypes.c_void_p(base + lo + i * PAGE), ctypes.c_size_t(PAGE), vec) != 0 or not vec[0] & 1:
                return False
        return True

    def drop_mapped(self, path: str, start: int, end: int) -> None:
        """Give back ``[start, end)`` of a mapped shard: unmap its pages from this process (``MADV_DONTNEED``; the
        next touch faults them in again from the file) and drop them from the page cache (``POSIX_FADV_DONTNEED``,
        which skips pages still mapped, hence the unmap first). Best effort: errors are ignored."""
        mm = self._maps.get(path)
        if mm is None or not hasattr(mm, "madvise"):
            return
        lo = (start // PAGE) * PAGE
        hi = min(len(mm), end)
        if hi <= lo:
            return
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            return
        _drop_cached(self._fd(path), lo, hi - lo)

    def advise_willneed(self, path: str, start: int, end: int) -> None:
        """Ask the kernel to start reading ``[start, end)`` of a mapped shard now (readahead for the next block)."""
        mm = self._maps.get(path)
        if mm is None or not hasattr(mm, "madvise"):
            return
        lo = (start // PAGE) * PAGE
        hi = min(len(mm), end)
        if hi > lo:
            mm.madvise(mmap.MADV_WILLNEED, lo, hi - lo)

    def make_resident(self, path: str, start: int, end: int) -> None:
        """Map ``[start, end)`` of a shard's memory map into this process now (reading it if not cached).

        One ``MADV_POPULATE_READ`` call maps page-cache pages in large folios: a warm 2 GB checkpoint becomes
        resident in ~0.1 s, where copying it into fresh memory costs seconds of page faults. Falls back to
        touching one byte per page on kernels without it.
        """
        mm = self.mapping(path)
        lo = (start // PAGE) * PAGE
        hi = min(len(mm), end)
        if hi <= lo:
            return
        libc = _get_libc()
        if libc:
            base = self._base(path, mm)
            if libc.madvise(ctypes.c_void_p(base + lo), ctypes.c_size_t(hi - lo), MADV_POPULATE_READ) == 0:
                return
        touched = torch.frombuffer(mm, dtype=torch.uint8, count=hi - lo, offset=lo)[::PAGE]
        int(touched.sum())

    def close_files(self) -> None:
        """Close plain file descriptors (maps stay open: mapped tensors still point into them)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    @property
    def maps(self) -> dict[str, mmap.mmap]:
        return self._maps
