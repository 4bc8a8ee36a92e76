"""Disk readahead on a host without GPUs: disk tensors are memory maps of the shards, so the kernel pages them in
at first use. As disk block i starts, a forward pre-hook asks the kernel to read block i's bytes and block i+1's
(``madvise(WILLNEED)``), so cold-cache decoding overlaps reads with compute; a few-page ``mincore`` probe skips the
advice when the bytes are already cached.

Where the disk share is larger than the memory left for the page cache (a model bigger than its box), every page
is evicted before the next token wants it again, whatever is kept: a cyclic scan over more than the cache holds
misses every time under LRU. Left to the kernel, that eviction is reclaim in the box's own allocations: each page
read ahead for block i+1 must first push out a page of an earlier block (still mapped, and recently used, so the
reclaimer scans past it), and read-ahead pages not yet used are evicted too and faulted in again one by one. With
``drop_behind``, block i's pre-hook gives block i-1's pages back at once (:meth:`ShardReader.drop_mapped`), so
read-ahead finds free memory and the disk streams at its own rate.

In that mode the next block is not only advised but read: a thread maps block i+1's pages in
(:meth:`ShardReader.make_resident`, one ``MADV_POPULATE_READ`` per range) while block i computes. Advice alone
overlapped little: one ``MADV_WILLNEED`` over a whole block starts only its first few MiB, so the products faulted
the rest in page by page and a step cost its reads plus its products. With the thread a step costs about the larger
of the two: the 1.03B fp32 in a 3 GiB box went from 1.36-1.40 to 1.89-2.15 tok/s on a Zen 4 (docs/benchmarks.md).
A block's read is waited for before its pages are dropped (a read still running would fault them in again), and a
queued read of a block the step has passed is skipped.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from loaders.checkpoint.device_order import module_for_entry

log = logging.getLogger(__name__)


class DiskReadahead:
    """Forward pre-hooks that, as disk block i starts, ask the kernel to read its bytes and block i+1's ahead (in
    drop-behind mode, a thread reads block i+1 into the map)."""

    def __init__(self, reader, blocks: list[tuple[str, list[tuple[str, int, int]]]], drop_behind: bool = False):
        self.reader = reader
        self.blocks = blocks
        self.handles = []
        #: Whether each block's pre-hook drops the previous block's pages (see the module docstring).
        self.drop_behind = drop_behind and len(blocks) > 1
        #: Drop-behind mode's reader of the next block, one read at a time in the order the step asks.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="loadmaster-readahead") if self.drop_behind else None
        self._reads: dict[int, Future] = {}  # block -> its read, until the block's pages are dropped
        self._wanted = -1  # the block the step will reach next: a queued read of any other is skipped

    def install(self, model: torch.nn.Module) -> None:
        for i, (key, own) in enumerate(self.blocks):
            j = (i + 1) % len(self.blocks)
            mod = module_for_entry(model, key)
            # Its own bytes first (a no-op when cached; after eviction it turns 4 KiB faults into large reads),
            # then the next block's, which the kernel (or the thread) reads while this block computes.
            ranges = own if self._thread is not None or len(self.blocks) == 1 else own + self.blocks[j][1]
            done = i - 1 if self.drop_behind else None  # block i-1, cyclically: computed by now
            self.handles.append(mod.register_forward_pre_hook(self._hook(ranges, done, j)))

    def _read(self, j: int) -> None:
        """Map block ``j``'s pages in (reading them from disk), unless the step has moved past it."""
        for path, start, end in self.blocks[j][1]:
            if self._wanted != j:
                return
            try:
                self.reader.make_resident(path, start, end)
            except Exception:  # noqa: BLE001 - best effort off the step's path: the products fault in what is missing
                log.warning("reading disk block %d ahead failed; its pages will be faulted in", j, exc_info=True)
                return

    def _hook(self, ranges, done: int | None, j: int):
        reader = self.reader

        def prefetch_next(module, args):
            if done is not None:
                read = self._reads.pop(done % len(self.blocks), None)
                if read is not None:
                    read.result()  # a read still running would fault the pages in again
                for path, start, end in self.blocks[done][1]:
                    reader.drop_mapped(path, start, end)
            for path, start, end in ranges:
                try:
                    # A warm block needs no advice, and advising one costs ~0.3 ms a block (every page is looked
                    # up): probe a few pages first, which costs microseconds.
                    if not reader.is_cached(path, start, end):
                        reader.advise_willneed(path, start, end)
                except (OSError, ValueError):
                    pass
            if self._thread is not None:
                self._wanted = j
                self._reads[j] = self._thread.submit(self._read, j)
            return None

        return prefetch_next

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self._thread is not None:
            self._wanted = -1  # queued reads are skipped
            self._thread.shutdown(wait=True)
            self._reads.clear()

    def wait_for_reads(self) -> None:
        """Wait until the thread's reads asked so far have ended (or been skipped)."""
        for read in list(self._reads.values()):
            read.result()


def merge_ranges(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Byte ranges of one file that touch or nearly touch (within a page) joined, so each block advises once."""
    out: list[tuple[str, int, int]] = []
    for path, s, e in sorted(ranges):
        if out and out[-1][0] == path and s <= out[-1][2] + 4096:
            out[-1] = (path, out[-1][1], max(out[-1][2], e))
        else:
            out.append((path, s, e))
    return out
