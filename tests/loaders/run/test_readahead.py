"""Disk-block readahead on a host without GPUs: advice only when the next block's bytes are not cached."""

from __future__ import annotations

import mmap
import os

import torch

import loaders
from loaders.checkpoint.shard_reader import ShardReader
from loaders.run.readahead import DiskReadahead
from tests.loaders.helpers import copy_checkpoint

MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux >= 5.4; Python < 3.12 lacks the constant


def _page_out(reader: ShardReader, path: str, start: int, end: int) -> None:
    """Drop a mapped range from memory and from the page cache (clean file pages), as memory pressure would.

    Only the whole pages inside the range: a page it shares with a resident tensor is locked (loaders.checkpoint.residency),
    and paging out a locked page is refused, as memory pressure would leave it."""
    mm = reader.mapping(path)
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = min(len(mm), end) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        mm.madvise(MADV_PAGEOUT, lo, hi - lo)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _sync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _inner_pages_cached(reader: ShardReader, path: str, start: int, end: int) -> bool:
    """Whether the whole pages inside a range are cached: a page a block shares with its neighbour stays while the
    neighbour's pages are mapped in."""
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = end // mmap.PAGESIZE * mmap.PAGESIZE
    return hi <= lo or reader.is_cached(path, lo, hi)


def test_is_cached_follows_the_page_cache(tmp_path):
    path = tmp_path / "blob.bin"
    size = 8 << 20
    path.write_bytes(os.urandom(size))
    _sync(path)
    reader = ShardReader()
    reader.mapping(str(path))
    reader.make_resident(str(path), 0, size)
    assert reader.is_cached(str(path), 0, size)
    _page_out(reader, str(path), 0, size)
    assert not reader.is_cached(str(path), 0, size)
    reader.make_resident(str(path), 0, size)
    assert reader.is_cached(str(path), 0, size)
    assert not reader.is_cached(str(tmp_path / "never-mapped"), 0, size)


def test_readahead_advises_only_cold_blocks_and_results_do_not_change(tiny_llama, tmp_path):
    # A private copy: other models in this process map the fixture's shards, which would keep its pages cached.
    path = copy_checkpoint(tiny_llama, tmp_path / "model")
    for f in path.glob("*.safetensors"):
        _sync(f)  # dirty pages cannot be dropped
    dm = {"model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "disk", "": "cpu"}
    model = loaders.load_model(path, device_map=dm, offload_folder=tmp_path / "off", show_progress=False)
    ra = model._loadmaster_readahead
    reader = model._loadmaster_reader
    advised: list[tuple[str, int, int]] = []
    real = reader.advise_willneed
    reader.advise_willneed = lambda path, start, end: (advised.append((path, start, end)), real(path, start, end))
    ids = torch.arange(1, 10).unsqueeze(0)
    with torch.no_grad():
        first = model(ids).logits
        advised.clear()
        warm = model(ids).logits
        assert advised == []  # every disk block was cached: no advice, no cost
        for _, ranges in ra.blocks:
            for path, start, end in ranges:
                _page_out(reader, path, start, end)
        cold = model(ids).logits
    assert advised, "cold disk blocks were not advised"
    assert torch.equal(first, warm) and torch.equal(first, cold)


def test_an_embedding_on_disk_is_looked_up_not_read_ahead(tiny_llama, tmp_path):
    """The planner puts an input embedding on disk first (one row a token). A lookup faults in its rows from the
    shard's map; the readahead must not read the whole table ahead on every step. Logits equal the resident load."""
    path = copy_checkpoint(tiny_llama, tmp_path / "model")
    dm = {"model.embed_tokens": "disk", "model.layers.3": "disk", "": "cpu"}
    model = loaders.load_model(path, device_map=dm, offload_folder=tmp_path / "off", show_progress=False)
    entries = [key for key, _ in model._loadmaster_readahead.blocks]
    assert entries == ["model.layers.3"], entries
    reference = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    ids = torch.arange(1, 10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_drop_behind_reads_the_next_block_in_and_gives_back_the_previous_one(tmp_path):
    """Three 16 MiB blocks of a file, cold: block i's pre-hook drops block i-1's pages and a thread reads block i+1
    in. After one pass (and the thread's reads) block 0 is in the cache again for the next pass, block 1 is gone
    (its second half: reading block 0 may read a little past its end) and block 2 is still there."""
    block = 16 << 20
    path = tmp_path / "blocks.bin"
    path.write_bytes(os.urandom(3 * block))
    _sync(path)
    reader = ShardReader()
    reader.mapping(str(path))
    blocks = [(str(i), [(str(path), i * block, (i + 1) * block)]) for i in range(3)]
    for _, ((p, s, e),) in blocks:
        _page_out(reader, p, s, e)
    model = torch.nn.Sequential(*(torch.nn.Identity() for _ in range(3)))
    ra = DiskReadahead(reader, blocks, drop_behind=True)
    ra.install(model)
    model(torch.zeros(1))
    ra.wait_for_reads()
    assert reader.is_cached(str(path), 0, block)
    assert not reader.is_cached(str(path), block + block // 2, 2 * block)
    assert reader.is_cached(str(path), 2 * block, 3 * block)
    ra.remove()


def test_drop_behind_gives_back_each_block_once_the_next_starts(tiny_llama, tmp_path):
    """A disk share larger than the cache room on a real model: each block's pre-hook drops the previous block's
    pages and a thread reads the next block in, so after a forward (and the thread's reads) the last disk block is
    still cached and the first was read in again for the next token (the middle one is dropped, but these blocks are
    smaller than the kernel's readahead, which reads it in again with the first); the logits are those of the
    resident load."""
    path = copy_checkpoint(tiny_llama, tmp_path / "model")
    for f in path.glob("*.safetensors"):
        _sync(f)  # dirty pages cannot be dropped
    dm = {"model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "disk", "": "cpu"}
    model = loaders.load_model(path, device_map=dm, offload_folder=tmp_path / "off", show_progress=False)
    kept = model._loadmaster_readahead
    assert not kept.drop_behind, "a tiny disk share fits the cache: its pages stay"
    kept.remove()
    ra = DiskReadahead(kept.reader, kept.blocks, drop_behind=True)
    ra.install(model)
    reader = model._loadmaster_reader
    reference = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    ids = torch.arange(1, 10).unsqueeze(0)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(ids).logits, reference(ids).logits)
            ra.wait_for_reads()
            cached = [all(_inner_pages_cached(reader, *r) for r in ranges) for _, ranges in ra.blocks]
            assert cached[0] and cached[2], cached
    ra.remove()
