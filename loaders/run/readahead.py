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
"""

from __future__ import annotations

import torch

from loaders.checkpoint.device_order import module_for_entry


class DiskReadahead:
    """Forward pre-hooks that, as disk block i starts, ask the kernel to read its bytes and block i+1's ahead."""

    def __init__(self, reader, blocks: list[tuple[str, list[tuple[str, int, int]]]], drop_behind: bool = False):
        self.reader = reader
        self.blocks = blocks
        self.handles = []
        #: Whether each block's pre-hook drops the previous block's pages (see the module docstring).
        self.drop_behind = drop_behind and len(blocks) > 1

    def install(self, model: torch.nn.Module) -> None:
        for i, (key, own) in enumerate(self.blocks):
            nxt = self.blocks[(i + 1) % len(self.blocks)][1]
            mod = module_for_entry(model, key)
            # Its own bytes first (a no-op when cached; after eviction it turns 4 KiB faults into large reads),
            # then the next block's, which the kernel reads while this block computes.
            ranges = own + nxt if len(self.blocks) > 1 else own
            done = self.blocks[i - 1][1] if self.drop_behind else []  # block i-1, cyclically: computed by now
            self.handles.append(mod.register_forward_pre_hook(self._hook(ranges, done)))

    def _hook(self, ranges, done):
        reader = self.reader

        def prefetch_next(module, args):
            for path, start, end in done:
                reader.drop_mapped(path, start, end)
            for path, start, end in ranges:
                try:
                    # A warm block needs no advice, and advising one costs ~0.3 ms a block (every page is looked
                    # up): probe a few pages first, which costs microseconds.
                    if not reader.is_cached(path, start, end):
                        reader.advise_willneed(path, start, end)
                except (OSError, ValueError):
                    pass
            return None

        return prefetch_next

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def merge_ranges(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Byte ranges of one file that touch or nearly touch (within a page) joined, so each block advises once."""
    out: list[tuple[str, int, int]] = []
    for path, s, e in sorted(ranges):
        if out and out[-1][0] == path and s <= out[-1][2] + 4096:
            out[-1] = (path, out[-1][1], max(out[-1][2], e))
        else:
            out.append((path, s, e))
    return out
