"""How fast this machine reads a checkpoint's own files from storage, cold: the rate the disk tier streams at.

A plan that leaves weights on disk decodes at about the storage's read rate divided by the bytes each token
streams, so its prediction is only as true as that rate. ``loadmaster env --calibrate`` records one for the
machine; without it the cost model would assume a generic NVMe figure (2 GB/s), which a virtual disk may not
reach by half. So a server that plans a disk tier and has no calibrated rate measures one here, on the shards it
will stream, before it plans.

A server plans with :func:`streamed_read_rate`: the shards read the way its disk tier is read while it decodes,
through their memory maps, each block advised ahead and faulted in while the one before it is given back
(:class:`loaders.run.readahead.DiskReadahead`). On a virtual disk that rate and the one of ``O_DIRECT`` reads
of one request at a time differ by up to 2x either way (the page cache's readahead keeps several requests in
flight, and 2 MiB requests queued deep by whole-block advice ran slower still), and the plan's prediction is only
as true as the rate it was given.

:func:`cold_read_rate`, the device's own rate (the benchmarks' ideal), uses ``O_DIRECT`` into a page-aligned
buffer: it measures the device, not the page cache, and leaves no pages behind to evict the resident weights it is
about to load. Where a file system refuses ``O_DIRECT`` (tmpfs,
some overlays) the pages are dropped with ``POSIX_FADV_DONTNEED`` first and read buffered.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loaders.checkpoint.shard_reader import ShardReader

#: Bytes of one streamed block: about a decoder layer of a 1B model in bf16.
STREAM_BLOCK = 64 << 20
#: Bytes one read asks for: large enough that the device, not the call, sets the pace.
CHUNK = 16 << 20


@dataclass(frozen=True)
class DiskRate:
    """A measured read: bytes per second, how it was read, and how much."""

    bytes_per_s: float
    method: str
    bytes_read: int
    seconds: float


def cold_read_rate(files: Sequence[Path], limit: int | None = None) -> DiskRate:
    """Read ``files`` in order (at most ``limit`` bytes in all; None: every byte) and time it."""
    try:
        done, seconds = _direct_read(files, limit)
        method = "O_DIRECT"
    except OSError:  # a file system without O_DIRECT
        done, seconds = _buffered_cold_read(files, limit)
        method = "buffered after POSIX_FADV_DONTNEED"
    return DiskRate(done / seconds if seconds > 0 else 0.0, method, done, seconds)


def _direct_read(files: Sequence[Path], limit: int | None) -> tuple[int, float]:
    buf = mmap.mmap(-1, CHUNK)  # anonymous maps are page-aligned, as O_DIRECT wants
    done = 0
    started = time.perf_counter()
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                offset = 0
                while (limit is None or done < limit) and (n := os.preadv(fd, [buf], offset)):
                    offset += n
                    done += n
            finally:
                os.close(fd)
            if limit is not None and done >= limit:
                break
    finally:
        buf.close()
    return done, time.perf_counter() - started


def _buffered_cold_read(files: Sequence[Path], limit: int | None) -> tuple[int, float]:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    done = 0
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while (limit is None or done < limit) and (n := f.readinto(view)):
                done += n
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if limit is not None and done >= limit:
            break
    return done, time.perf_counter() - started


def streamed_read_rate(files: Sequence[Path], limit: int) -> DiskRate:
    """Read at most ``limit`` bytes of ``files`` as the disk tier streams them, cold, and time it.

    Blocks of :data:`STREAM_BLOCK`: each is advised with the next (``MADV_WILLNEED``), faulted in whole
    (:meth:`ShardReader.make_resident`, the page-fault path a decode step takes), and the one before it given back
    (:meth:`ShardReader.drop_mapped`), so nothing is left cached. Falls back to :func:`cold_read_rate` where the
    files cannot be mapped or their pages dropped first (then the probe would time the page cache)."""
    blocks: list[tuple[str, int, int]] = []
    left = limit
    for path in files:
        size = path.stat().st_size
        for start in range(0, min(size, left), STREAM_BLOCK):
            blocks.append((str(path), start, min(size, start + STREAM_BLOCK, left)))
        left -= min(size, left)
        if left <= 0:
            break
    reader = ShardReader()
    try:
        for path, start, end in blocks:
            reader.mapping(path)
            reader.drop_cached(path, start, end)
        if not blocks or any(reader.is_cached(path, start, end) for path, start, end in blocks):
            return cold_read_rate(files, limit)
        started = time.perf_counter()
        for i, (path, start, end) in enumerate(blocks):
            for ahead in blocks[i : i + 2]:
                reader.advise_willneed(*ahead)
            reader.make_resident(path, start, end)
            if i:
                reader.drop_mapped(*blocks[i - 1])
        seconds = time.perf_counter() - started
        for path in {path for path, _, _ in blocks}:  # the last block, and what readahead read past the limit
            reader.drop_mapped(path, 0, len(reader.mapping(path)))
    except (OSError, ValueError):
        return cold_read_rate(files, limit)
    finally:
        reader.close_files()
    done = sum(end - start for _, start, end in blocks)
    return DiskRate(
        done / seconds if seconds > 0 else 0.0, "mapped, read ahead as the disk tier streams", done, seconds
    )
