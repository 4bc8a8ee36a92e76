"""The GPU streaming schedule, exercised on the CPU through the streamer's backend interface.

Two backends bracket real CUDA behaviour: ``CpuBackend`` copies eagerly (as early as possible), ``LazyBackend``
defers every side-stream copy until something waits for it (as late as CUDA may run it). A streamer that forgot a
wait would compute on stale weights under the lazy backend; one that overwrote a running block's slot would be
caught by the eager backend's check. Both must reproduce transformers' logits exactly.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import loaders
from loaders.checkpoint.device_order import ordered_entries
from loaders.run.streaming import BlockStreamer, CpuBackend, build_blocks
from tests.loaders.helpers import assert_equivalent, copy_checkpoint, prompt

LLAMA_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


class LazyBackend(CpuBackend):
    """Side-stream copies queue up and run only when an event after them is waited for."""

    def __init__(self):
        super().__init__()
        self.queue: list = []
        self.flushed = 0

    def record(self, stream):
        if stream == "side":
            return ("side", len(self.queue) + self.flushed)
        return ("compute", 0)

    def _flush(self, upto: int) -> None:
        while self.flushed < upto:
            self.queue.pop(0)()
            self.flushed += 1

    def wait(self, stream, event):
        if event[0] == "side":
            self._flush(event[1])

    def host_wait(self, event):
        self.wait("host", event)

    def copy(self, dst, src, stream):
        if stream == "side":
            self.queue.append(lambda: dst.copy_(src))
        else:
            dst.copy_(src)


def _streamed(path, device_map, backend, n_slots=2, offload_folder=None):
    model = loaders.load_model(path, device_map=device_map, show_progress=False, offload_folder=offload_folder)
    placement = {n: "cpu" for n, _ in model.named_parameters()}
    blocks, resident = build_blocks(model, ordered_entries(model, device_map), placement, device_map)
    streamer = BlockStreamer(blocks, backend, n_slots=n_slots)
    streamer.install()
    return model, streamer, resident


class GuardedBackend(CpuBackend):
    """Eager copies that fail if they land in the slot of a block that is still running."""

    streamer = None
    copies = 0

    def copy(self, dst, src, stream):
        st = self.streamer
        if st is not None:
            for s in st._running:
                buf = st.slots[s].buffer
                lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
                assert not lo <= dst.data_ptr() < hi, "a copy overwrote the slot of a running block"
        self.copies += 1
        super().copy(dst, src, stream)


def test_streamed_llama_matches_transformers_with_eager_copies(tiny_llama):
    backend = GuardedBackend()
    model, streamer, _ = _streamed(tiny_llama, LLAMA_MAP, backend)
    backend.streamer = streamer
    assert_equivalent(model, tiny_llama)
    assert len(streamer.slots) == 2
    assert len(streamer.blocks) == 8
    assert backend.copies > 0


def test_nested_blocks_never_overwrite_a_running_slot(tiny_gpt2):
    backend = GuardedBackend()
    model, streamer, _ = _streamed(tiny_gpt2, {"": "cpu", "transformer.h.1": "disk"}, backend)
    backend.streamer = streamer
    assert_equivalent(model, tiny_gpt2)


def test_streamed_llama_matches_transformers_with_late_copies(tiny_llama):
    model, streamer, _ = _streamed(tiny_llama, LLAMA_MAP, LazyBackend())
    assert_equivalent(model, tiny_llama)


def test_prefetch_learns_execution_order(tiny_llama):
    model, streamer, _ = _streamed(tiny_llama, LLAMA_MAP, CpuBackend())
    ids = prompt(model.config.vocab_size)
    n = len(streamer.blocks)
    with torch.no_grad():
        model(ids)
        first_sync = streamer.sync_loads
        loads_after_first = streamer.loads
        for _ in range(3):
            model(ids)
    # rotary_emb runs right after the embeddings although it is registered last: only the first pass misses
    assert first_sync >= 1
    assert streamer.sync_loads == first_sync, "after one pass every block must have been prefetched"
    assert streamer.loads == loads_after_first + 3 * n, "each block is copied exactly once per forward"


def test_weights_leave_the_slots_between_uses(tiny_llama):
    model, streamer, _ = _streamed(tiny_llama, LLAMA_MAP, CpuBackend())
    with torch.no_grad():
        model(prompt(model.config.vocab_size))
    slot_ranges = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in streamer.slots]
    for block in streamer.blocks:
        for t in block.tensors:
            ptr = getattr(t.module, t.leaf).data_ptr()
            assert not any(lo <= ptr < hi for lo, hi in slot_ranges), f"{block.key}.{t.leaf} still points at a slot"


def test_nested_entries_are_split_into_non_nested_blocks(tiny_gpt2):
    dm = {"": "cpu", "transformer.h.1": "disk", "transformer.h.2.mlp": "disk"}
    model, streamer, resident = _streamed(tiny_gpt2, dm, LazyBackend())
    keys = [b.key for b in streamer.blocks]
    assert "" not in keys and "transformer" not in keys
    for a in keys:
        for b in keys:
            assert a == b or not b.startswith(a + "."), f"{b} nests inside {a}"
    assert {"transformer.h.1", "transformer.h.2.mlp", "transformer.h.2.attn", "lm_head"} <= set(keys)
    assert_equivalent(model, tiny_gpt2)


@pytest.mark.parametrize("n_slots", [2, 3])
def test_moe_streamed_with_more_slots(tiny_moe, n_slots, tmp_path):
    dm = {"model.layers.1": "disk", "model.layers.3": "disk", "": "cpu"}
    model, streamer, _ = _streamed(tiny_moe, dm, LazyBackend(), n_slots=n_slots, offload_folder=tmp_path / "o")
    assert len(streamer.slots) == n_slots
    assert_equivalent(model, tiny_moe)


def test_streamer_refuses_a_single_slot():
    with pytest.raises(ValueError):
        BlockStreamer([], CpuBackend(), n_slots=1)


def test_move_to_moves_tensors_in_containers_and_leaves_caches_alone():
    from transformers import DynamicCache

    from loaders.run.streaming import move_to

    cache = DynamicCache()
    t = torch.ones(2, dtype=torch.float64)
    args = (t, [t, 3], {"a": t, "cache": cache}, cache, None)
    moved = move_to(args, torch.device("meta"))
    assert moved[0].device.type == "meta" and moved[1][0].device.type == "meta" and moved[1][1] == 3
    assert moved[2]["a"].device.type == "meta" and moved[2]["cache"] is cache
    assert moved[3] is cache and moved[4] is None


def test_gpu_wiring_runs_with_the_cpu_backend(tiny_gpt2):
    """install_gpu_execution itself (align hooks, root hooks, blocks, tied head), with CPU standing in for CUDA."""
    from loaders.run.streaming import install_gpu_execution

    dm = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h.0": "cpu",
        "transformer.h.1": "disk",
        "transformer.h.2": "cpu",
        "transformer.h.3": "disk",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    }
    model = loaders.load_model(tiny_gpt2, device_map=dm, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    streamer = install_gpu_execution(model, dm, placement, torch.device("cpu"), backend=LazyBackend())
    # the token and position embeddings are looked up on the host, everything else is streamed
    assert streamer is not None and {b.key for b in streamer.blocks} == set(dm) - {"transformer.wte", "transformer.wpe"}
    # the tied head is streamed on its own, from the same host tensor as the embeddings
    head = next(b for b in streamer.blocks if b.key == "lm_head")
    assert head.tensors[0].host.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert_equivalent(model, tiny_gpt2)


SPLIT_MAPS = [
    {"": "cpu", "model.layers.0": 0},  # the root entry split around a GPU layer (issue 14 item 6)
    {"model": "cpu", "lm_head": "cpu", "model.layers.0": 0},  # a non-root entry split the same way
]


@pytest.mark.parametrize("dm", SPLIT_MAPS)
def test_pieces_split_off_a_containing_entry_get_their_inputs_aligned(tiny_llama, dm):
    """Two-device stand-in: GPU 0 is the CPU, the execution device is ``meta``. Every streamed piece split off
    the containing entry (later layers, norm, head) must receive its inputs on the execution device;
    without an alignment hook the CPU tensor a parent hands it arrives as it was (a device mismatch on CUDA)."""
    from loaders.run.streaming import install_gpu_execution

    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    streamer = install_gpu_execution(
        model, dm, placement, torch.device("meta"), backend=CpuBackend(), gpu_device=lambda i: torch.device("cpu")
    )
    assert streamer is not None
    keys = {b.key for b in streamer.blocks}
    # the embeddings are looked up on the host (test_a_host_embedding_hands_its_rows_to_the_execution_device)
    assert {"model.layers.1", "model.norm", "lm_head"} <= keys and "model.embed_tokens" not in keys
    seen: dict[str, torch.device] = {}
    for block in streamer.blocks:
        # the probe replaces only this piece's own computation; its hooks (alignment, streaming) run for real
        block.module.forward = lambda x, key=block.key: seen.setdefault(key, x.device) and x
        block.module(torch.ones(2))
    assert seen == dict.fromkeys(keys, torch.device("meta")), seen


@pytest.mark.parametrize("dm", SPLIT_MAPS)
def test_split_root_wiring_matches_transformers(tiny_llama, dm):
    """The same maps run end to end with the CPU standing in for GPU 0 and for the execution device."""
    from loaders.run.streaming import install_gpu_execution

    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    streamer = install_gpu_execution(
        model, dm, placement, torch.device("cpu"), backend=LazyBackend(), gpu_device=lambda i: torch.device("cpu")
    )
    assert streamer is not None and "model.layers.0" not in {b.key for b in streamer.blocks}
    assert_equivalent(model, tiny_llama)


def test_a_failed_block_frees_its_slot_and_the_next_forward_prefetches_again(tiny_llama):
    """A block that raises (an OOM on a GPU) must still run the post-hook (issue 14 item 7): its slot is released,
    its host tensors are back, and the next forward finds every block prefetched, with the same logits."""
    model, streamer, _ = _streamed(tiny_llama, LLAMA_MAP, GuardedBackend())
    streamer.backend.streamer = streamer
    ids = prompt(model.config.vocab_size)
    layer = model.model.layers[2]
    with torch.no_grad():
        model(ids)
        model(ids)  # the order is learned: from here on no block waits for a copy
        steady = streamer.sync_loads
        forward = layer.forward
        layer.forward = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("stand-in OOM"))
        with pytest.raises(torch.OutOfMemoryError):
            model(ids)
        layer.forward = forward
        assert streamer._running == set(), "the failed block's slot is still marked running"
        block = next(b for b in streamer.blocks if b.key == "model.layers.2")
        assert all(getattr(t.module, t.leaf).data_ptr() == t.host.data_ptr() for t in block.tensors)
        assert streamer.sync_loads == steady
        for _ in range(2):
            model(ids)
        assert streamer.sync_loads == steady, "a forward after the failure waited for a copy it should have prefetched"
    assert_equivalent(model, tiny_llama)


class ArenaBackend(LazyBackend):
    """``LazyBackend`` whose device buffers come from a stand-in of torch's caching allocator: a freed buffer is
    handed out again at once (to the stream it was allocated on), unless it was marked as used by another stream
    (``record_stream``) that still has copies queued, exactly as the CUDA allocator defers such blocks."""

    def __init__(self):
        super().__init__()
        self.arena = torch.zeros(1 << 22, dtype=torch.uint8)
        self.top = 0
        self.free: list[tuple[int, int, int | None]] = []  # (offset, bytes, side copies that must have run first)
        self.marked: set[int] = set()

    def empty(self, nbytes, pinned=False):
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        for k, (lo, n, upto) in enumerate(self.free):
            if n == nbytes and (upto is None or self.flushed >= upto):
                del self.free[k]
                return self._hand_out(lo, n)
        lo, self.top = self.top, self.top + (nbytes + 255) // 256 * 256
        assert self.top <= self.arena.numel()
        return self._hand_out(lo, nbytes)

    def _hand_out(self, lo, n):
        t = self.arena[lo : lo + n]
        weakref.finalize(t, self._freed, lo, n)
        return t

    def record_stream(self, tensor, stream):
        if stream == "side":
            self.marked.add(tensor.data_ptr() - self.arena.data_ptr())

    def _freed(self, lo, n):
        upto = len(self.queue) + self.flushed if lo in self.marked else None
        self.marked.discard(lo)
        self.free.append((lo, n, upto))


def test_freed_slots_are_not_handed_out_while_a_prefetch_still_writes_them(tiny_llama):
    """Issue 14 item 8: the slots are written on the side stream but allocated on the compute stream. Without
    ``record_stream``, unloading the model returns them to the allocator while the last prefetch (the next forward's
    first block) is still queued, the reload gets the same memory, and the late copy overwrites it."""
    backend = ArenaBackend()
    model, streamer, _ = _streamed(tiny_llama, LLAMA_MAP, backend)
    with torch.no_grad():
        model(prompt(model.config.vocab_size))
    # every block here is staged, so the staging thread queues the prefetch's copies: wait until it has
    _settle(streamer)
    assert backend.queue, "the next forward's first block should be in flight"
    slot_bytes = streamer.slot_bytes
    streamer.remove()
    del streamer, model
    gc.collect()
    assert len(backend.free) == 2, "unloading should free both slots"
    reloaded = [backend.empty(slot_bytes) for _ in range(2)]
    for buf in reloaded:
        buf.zero_()
    backend._flush(backend.flushed + len(backend.queue))  # the GPU finishes the copies it was given
    assert all(int(buf.count_nonzero()) == 0 for buf in reloaded), "a late prefetch wrote into reallocated memory"


class CountingBackend(CpuBackend):
    """Eager copies, counting the bytes that cross to the execution device."""

    copied = 0

    def copy(self, dst, src, stream):
        self.copied += dst.numel() * dst.element_size()
        super().copy(dst, src, stream)


def _settle(streamer) -> None:
    """Wait for the copies the staging thread has queued, so that byte counts taken now are not mid-prefetch."""
    for slot in streamer.slots:
        if slot.pending is not None:
            slot.pending.result()


def test_offloaded_embeddings_are_looked_up_on_the_host_not_streamed(tiny_llama):
    """Issue 14 item 3: an embedding offloaded while GPUs compute was streamed whole every forward, although the
    planner costs it at one row per token. It now runs on the host: a forward copies the other blocks only."""
    from loaders.run.streaming import install_gpu_execution

    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    backend = CountingBackend()
    streamer = install_gpu_execution(model, LLAMA_MAP, placement, torch.device("cpu"), backend=backend)
    assert streamer is not None and "model.embed_tokens" not in {b.key for b in streamer.blocks}
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        model(ids)
        model(ids)  # the order is learned: from here on each forward copies each block once
        _settle(streamer)  # the staging thread may still be copying the next forward's first blocks
        before = backend.copied
        model(ids)
        _settle(streamer)
    table = model.model.embed_tokens.weight
    assert backend.copied - before == sum(t.nbytes for b in streamer.blocks for t in b.unique())
    everything = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
    assert backend.copied - before <= everything - table.nbytes
    assert_equivalent(model, tiny_llama)


def test_a_host_embedding_hands_its_rows_to_the_execution_device(tiny_llama):
    """Two-device stand-in (GPU 0 is the CPU, the execution device is ``meta``): the lookup runs where the table
    is, and what it returns is on the execution device, where the first layer and everything after run."""
    from loaders.run.streaming import install_gpu_execution

    dm = {"model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": 0, "": "cpu"}
    model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    install_gpu_execution(
        model, dm, placement, torch.device("meta"), backend=CpuBackend(), gpu_device=lambda i: torch.device("cpu")
    )
    rows = model.model.embed_tokens(torch.tensor([[1, 2, 3]]))
    assert rows.device == torch.device("meta") and rows.shape == (1, 3, model.config.hidden_size)
    assert model.model.embed_tokens.weight.device == torch.device("cpu")


def test_disk_blocks_are_staged_by_positioned_reads_not_page_faults(tiny_llama, monkeypatch):
    """Issue 14 item 12: a disk block was staged by copying from its memory map (a page fault per 4 KiB page). The
    streamer now reads the shard into the pinned staging buffer with ``preadv``: every disk block's bytes, each
    forward, and the same logits."""
    from loaders.checkpoint import shard_reader

    read: list[int] = []
    preadv = shard_reader.os.preadv

    def counting_preadv(fd, buffers, offset):
        n = preadv(fd, buffers, offset)
        read.append(n)
        return n

    model = loaders.load_model(tiny_llama, device_map=LLAMA_MAP, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters()}
    blocks, _ = build_blocks(model, ordered_entries(model, LLAMA_MAP), placement, LLAMA_MAP)
    streamer = BlockStreamer(blocks, CpuBackend(), reader=model._loadmaster_reader)
    streamer.install()
    on_disk = [b for b in streamer.blocks if LLAMA_MAP.get(b.key) == "disk"]
    staged = sum(t.nbytes for b in on_disk for t in b.unique())
    # (on this GPU-less host the "cpu" blocks are unpinned copies: staged too, by a memory copy, not a read)
    assert staged > 0 and {"model.layers.0", "model.layers.2"} == {b.key for b in on_disk if b.staged}
    monkeypatch.setattr(shard_reader.os, "preadv", counting_preadv)
    with torch.no_grad():
        for _ in range(2):
            model(prompt(model.config.vocab_size))
    assert sum(read) >= 2 * staged, f"{sum(read)} bytes read by preadv for {staged} staged bytes per forward"
    monkeypatch.undo()
    assert_equivalent(model, tiny_llama)


def test_a_disk_block_truncated_while_streaming_is_an_error_not_a_signal(tiny_llama, tmp_path):
    """Issue 38: the streamer stages disk blocks by positioned reads, so a shard truncated under a running model is
    a short read, raised as :class:`WeightsChangedError` naming the shard (the engine stops on it), never SIGBUS."""
    from loaders.errors import WeightsChangedError

    model_dir = copy_checkpoint(tiny_llama, tmp_path / "model")
    model = loaders.load_model(model_dir, device_map=LLAMA_MAP, show_progress=False)
    placement = {n: "cpu" for n, _ in model.named_parameters()}
    blocks, _ = build_blocks(model, ordered_entries(model, LLAMA_MAP), placement, LLAMA_MAP)
    streamer = BlockStreamer(blocks, CpuBackend(), reader=model._loadmaster_reader)
    streamer.install()
    with torch.no_grad():
        model(prompt(model.config.vocab_size))
    for shard in model_dir.glob("*.safetensors"):
        os.truncate(shard, 0)
    with torch.no_grad(), pytest.raises(WeightsChangedError, match=r"model-0000\d-of-0000\d\.safetensors ended"):
        model(prompt(model.config.vocab_size))
