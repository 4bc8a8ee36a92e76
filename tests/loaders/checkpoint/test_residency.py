"""Resident CPU weights are locked in memory (``cpu_residency="lock"``, the default): the process's locked bytes
grow by their size without copying them, disk blocks are not locked, the locks go with the model's tensors, and the
logits are those of an unlocked load."""

from __future__ import annotations

import gc

import pytest
import torch

import loaders
from loaders.checkpoint.residency import resident_tensors
from planner.errors import PlanError
from tests.loaders.helpers import prompt, smaps_bytes


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
    # pages, so a little more than the bytes (each range rounds out to whole pages)
    locked = _locked_bytes() - before
    assert want <= locked <= want + 2 * 4096 * len(resident)
    assert _copied_bytes_of_maps(tiny_llama.resolve()) == 0  # locked in place: the page cache's pages, not copies
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    del model, resident  # the locks end with the memory the tensors view
    gc.collect()
    assert _locked_bytes() - before < want


@pytest.mark.parametrize("lock", [True, False])
def test_a_range_is_locked_as_it_is_mapped_in(tiny_llama, lock):
    """The loader locks a resident range before it maps it in: the pages are locked as they are mapped (one pass),
    and they stay the page cache's own (no copy). Without the lock they are mapped in only."""
    from loaders.checkpoint.shard_reader import PAGE, ShardReader

    shard = str(sorted(tiny_llama.resolve().glob("*.safetensors"))[0])
    reader = ShardReader()
    size = len(reader.mapping(shard))
    gc.collect()
    before = _locked_bytes()
    if lock:
        assert reader.lock(shard, 0, size)
    reader.make_resident(shard, 0, size)
    locked = _locked_bytes() - before
    if lock:
        assert size <= locked <= size + PAGE
    else:
        assert locked == 0
    assert smaps_bytes("Rss", lambda _lo, line: line.rstrip().endswith(shard)) >= size - PAGE  # mapped in now
    assert _copied_bytes_of_maps(tiny_llama.resolve()) == 0


def test_unknown_residency_is_refused(tiny_llama):
    with pytest.raises(PlanError, match="cpu_residency='pinned' is not one of lock, map"):
        loaders.load_model(tiny_llama, device_map={"": "cpu"}, show_progress=False, cpu_residency="pinned")
