"""Resident CPU weights are private copies, locked in memory (``cpu_residency="lock"``, the default): the
process's locked bytes grow by their size, disk blocks are not locked (nor copied), the locks go with the model's
memory, the logits are those of an unlocked load, and the files changing on disk cannot reach them."""

from __future__ import annotations

import gc
import os

import pytest
import torch

import loaders
from loaders.checkpoint.residency import resident_tensors
from planner.errors import PlanError
from tests.loaders.helpers import copy_checkpoint, prompt, smaps_bytes


def _locked_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


def _copied_bytes_of_maps(folder) -> int:
    """Anonymous (copied-on-write) bytes of this process's maps of files in ``folder``: what locking a private map
    of a shard would cost if it copied the pages rather than locking the page cache's own."""
    return smaps_bytes("Anonymous", lambda _lo, line: str(folder) in line)


def test_resident_weights_are_locked_and_disk_ones_are_not(tiny_llama, tmp_path):
    dm = {"model.layers.1": "disk", "": "cpu"}
    kw = dict(device_map=dm, offload_folder=tmp_path / "off", show_progress=False, dtype="float32")
    plain = loaders.load_model(tiny_llama, cpu_residency="map", **kw)
    assert plain.load_stats.residency is None
    gc.collect()  # models of earlier tests freed now, not while this one loads (their locks would end mid-count)
    before = _locked_bytes()
    model = loaders.load_model(tiny_llama, **kw)
    st = model.load_stats.residency
    resident = resident_tensors(model, dm)
    want = sum(t.numel() * t.element_size() for _, t in resident)
    assert st is not None and st.error is None and st.locked_bytes == want
    assert not any(name.startswith("model.layers.1.") for name, _ in resident)
    assert any(name.startswith("model.layers.0.") for name, _ in resident)
    # pages: each range rounds out to whole pages, and small copies share pages of malloc's heap; a heap page that
    # an earlier test's copies still lock counts once, so the process's VmLck may grow by less than the copies
    locked = _locked_bytes() - before
    assert 0 < locked <= want + 2 * 4096 * len(resident)
    assert _copied_bytes_of_maps(tiny_llama.resolve()) == 0  # the disk blocks' maps are read in place, not copied
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    # (the locks end when the copies' memory goes back to the system; small tensors stay in malloc's heap)


def _cached_pages(path) -> int:
    """How many pages of ``path`` are in the page cache now (``mincore`` over a fresh map of it)."""
    from loaders.checkpoint.shard_reader import PAGE, ShardReader

    reader = ShardReader()
    size = len(reader.mapping(str(path)))
    return sum(reader.is_cached(str(path), lo, lo + PAGE, samples=1) for lo in range(0, size - PAGE, PAGE))


@pytest.mark.parametrize("residency", ["lock", "map"])
def test_resident_weights_are_private_copies_the_files_cannot_change(tiny_llama, tmp_path, residency, monkeypatch):
    """Issue 38: resident weights were private maps of the shards, so a shard truncated under the process killed it
    with SIGBUS (locked or not) and one rewritten in place changed its answers. They are copies in the process's
    own memory now: truncating every shard to nothing and rewriting it changes nothing, and the shards' pages were
    dropped from the page cache as they were copied (as in a tight box, which need not hold both)."""
    monkeypatch.setenv("LOADMASTER_DROP_PAGE_CACHE", "1")
    model_dir = copy_checkpoint(tiny_llama, tmp_path / "model")
    shards = sorted(model_dir.glob("*.safetensors"))
    for shard in shards:  # written back and out of the page cache: what is cached after the load, the load left
        fd = os.open(shard, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    model = loaders.load_model(model_dir, device_map={"": "cpu"}, show_progress=False, cpu_residency=residency)
    assert not model._loadmaster_reader.maps  # nothing of a shard is mapped
    big = max(shards, key=lambda p: p.stat().st_size)
    assert _cached_pages(big) <= 2  # of ~90: the header page, read by the index, is all that stays
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        before = model(ids).logits
    for shard in shards:
        size = shard.stat().st_size
        os.truncate(shard, 0)
        shard.write_bytes(os.urandom(size))  # the same size, other bytes: rsync --inplace
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    for shard in shards:
        os.truncate(shard, 0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_the_page_cache_is_dropped_where_the_box_cannot_hold_it_beside_the_copies(monkeypatch):
    from loaders.checkpoint.residency import drops_page_cache

    monkeypatch.delenv("LOADMASTER_DROP_PAGE_CACHE", raising=False)
    assert drops_page_cache(400 << 20, available=lambda: 600 << 20)  # a 640 MiB box and 0.4 GB to copy
    assert not drops_page_cache(400 << 20, available=lambda: 20 << 30)  # room for both: a restart reads the cache
    assert not drops_page_cache(0, available=lambda: 0)
    monkeypatch.setenv("LOADMASTER_DROP_PAGE_CACHE", "1")
    assert drops_page_cache(1, available=lambda: 20 << 30)
    monkeypatch.setenv("LOADMASTER_DROP_PAGE_CACHE", "0")
    assert not drops_page_cache(400 << 20, available=lambda: 1)


def test_unknown_residency_is_refused(tiny_llama):
    with pytest.raises(PlanError, match="cpu_residency='pinned' is not one of lock, map"):
        loaders.load_model(tiny_llama, device_map={"": "cpu"}, show_progress=False, cpu_residency="pinned")
