"""Running offloaded blocks on a GPU: weights streamed in just before use, the next block's copy overlapping.

Each offloaded block (a device-map entry on ``"cpu"`` or ``"disk"`` while GPUs compute) owns a fixed layout in
each of ``n_slots`` device buffers (two: double buffering). When block ``i`` starts:

1. its copy, already issued by block ``i-1``'s hook, is waited for *on the compute stream* (no host sync);
2. its parameters are pointed at views of its slot;
3. block ``i+1``'s copy is issued on a side stream into the other slot, after that slot's previous occupant
   (block ``i-1``) has finished computing (an event recorded when it ended, waited on by the side stream).

When block ``i`` ends, a "done" event is recorded and its parameters point back at their host tensors, so nothing
holds the device memory but the slots. ``"cpu"`` blocks are pinned at load time and copied directly; ``"disk"``
blocks are memory maps, so a reader thread first copies them into a pinned staging buffer (reading the disk
while the GPU computes), then the side stream copies that to the device. No ``empty_cache`` is ever called.

All device operations go through a small backend so the schedule is testable on a machine without CUDA: the
:class:`CpuBackend` runs the same code with plain CPU tensors and synchronous copies.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from loaders.checkpoint.device_order import entry_of, module_for_entry, ordered_entries
from loaders.checkpoint.shard_reader import ShardReader
from planner.types import DeviceId

log = logging.getLogger(__name__)

ALIGN = 256  # bytes; CUDA allocations are at least this aligned, keep views as aligned as fresh tensors


# ---------------------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------------------
class CpuBackend:
    """Synchronous stand-in for CUDA: same calls, CPU tensors, events that are always complete."""

    device = torch.device("cpu")

    def __init__(self, on_op: Callable[..., None] | None = None):
        self.on_op = on_op or (lambda *a: None)

    def empty(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def side_stream(self):
        return "side"

    def compute_stream(self):
        return "compute"

    def record(self, stream) -> Any:
        self.on_op("record", stream)
        return ("event", stream)

    def wait(self, stream, event) -> None:
        self.on_op("wait", stream, event)

    def host_wait(self, event) -> None:
        self.on_op("host_wait", event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        self.on_op("copy", stream)
        dst.copy_(src)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.on_op("record_stream", stream)


class CudaBackend:
    """The real thing: a side stream for copies, events between streams, pinned host staging."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = torch.cuda.Stream(device=device)

    def empty(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def side_stream(self):
        return self._side

    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def record(self, stream) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def host_wait(self, event) -> None:
        event.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``: once freed, its memory is handed out again
        only after the work queued on ``stream`` by then has finished (the allocator records the events at free)."""
        tensor.record_stream(stream)


# ---------------------------------------------------------------------------------------------------------------
# Blocks and the streamer
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class StreamedTensor:
    module: torch.nn.Module
    leaf: str
    host: torch.Tensor  # pinned CPU tensor, or a memory map of a shard
    offset: int = 0  # byte offset in the block's slot layout
    is_param: bool = True

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass
class StreamedBlock:
    key: str
    module: torch.nn.Module
    tensors: list[StreamedTensor]
    staged: bool = False  # host tensors are pageable (disk maps): go through pinned staging
    nbytes: int = 0

    def layout(self) -> int:
        """Give each distinct host tensor an aligned offset; tied tensors (one host, two modules) share theirs."""
        pos = 0
        placed: dict[int, int] = {}
        for t in self.tensors:
            key = id(t.host)
            if key not in placed:
                pos = (pos + ALIGN - 1) // ALIGN * ALIGN
                placed[key] = pos
                pos += t.nbytes
            t.offset = placed[key]
        self.nbytes = pos
        return pos

    def unique(self) -> list[StreamedTensor]:
        """One StreamedTensor per distinct host tensor (what must actually be copied)."""
        seen: set[int] = set()
        out = []
        for t in self.tensors:
            if id(t.host) not in seen:
                seen.add(id(t.host))
                out.append(t)
        return out


@dataclass
class _Slot:
    buffer: torch.Tensor
    staging: torch.Tensor | None = None
    block: int | None = None  # which block's weights the slot holds (or is receiving)
    ready: Any = None  # event: the copy into this slot has finished
    done: Any = None  # event: the last block computed from this slot has finished
    pending: Future | None = None  # staging read in flight (disk blocks)
    staging_free: Any = None  # event: the H2D copy out of the staging buffer finished


class BlockStreamer:
    """Streams offloaded blocks into ``n_slots`` device buffers, prefetching the next block while one runs."""

    def __init__(self, blocks: list[StreamedBlock], backend, n_slots: int = 2, reader: ShardReader | None = None):
        if n_slots < 2:
            raise ValueError("streaming needs at least two slots to overlap copy and compute")
        self.blocks = blocks
        self.backend = backend
        #: The shards' reader: disk blocks are staged by positioned reads of the files instead of page faults.
        self.reader = reader
        self.slot_bytes = max((b.layout() for b in blocks), default=0)
        need_staging = any(b.staged for b in blocks)
        n = n_slots if len(blocks) > 1 else 1
        self.slots = [
            _Slot(backend.empty(self.slot_bytes), backend.empty(self.slot_bytes, pinned=True) if need_staging else None)
            for _ in range(n)
        ]
        for slot in self.slots:
            # allocated on the compute stream, written on the side stream: when the model is unloaded, the last
            # prefetch may still be writing, so the allocator must not hand the memory out before it ends
            backend.record_stream(slot.buffer, backend.side_stream())
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="loadmaster-stage") if need_staging else None
        self.handles: list = []
        #: Observed execution order: block -> the block that ran after it last time. Module order is only the
        #: first guess (Llama runs rotary_emb right after the embeddings although it is registered last).
        self.next_of: dict[int, int] = {}
        self._last: int | None = None
        self._first: int | None = None  # the block a forward starts with (prefetched again after a failure)
        self.where: dict[int, int] = {}  # block -> slot it was last copied into
        self._cur_slot: int | None = None  # slot of the block that ran last (or runs now)
        self._running: set[int] = set()  # slots whose block is between its pre- and post-hook
        self.loads = 0  # copies issued (for tests and stats)
        self.sync_loads = 0  # copies a block had to wait for because nothing prefetched it

    def _slot_holding(self, i: int) -> int | None:
        s = self.where.get(i)
        return s if s is not None and self.slots[s].block == i else None

    # -- issuing copies --------------------------------------------------------------------------------------
    def _issue(self, i: int, s: int) -> None:
        """Start copying block ``i`` into slot ``s`` (side stream; staged through pinned memory for disk blocks)."""
        block, slot = self.blocks[i], self.slots[s]
        if slot.pending is not None:  # a staging job still targets this slot: let it finish first
            slot.pending.result()
            slot.pending = None
        self.where[i] = s
        side = self.backend.side_stream()
        if slot.done is not None:
            self.backend.wait(side, slot.done)  # the slot's previous occupant has finished computing
        slot.block = i
        self.loads += 1
        if not block.staged:
            for t in block.unique():
                self.backend.copy(self._view(slot.buffer, t), t.host, side)
            slot.ready = self.backend.record(side)
            slot.pending = None
            return

        def stage_then_copy():
            if slot.staging_free is not None:
                self.backend.host_wait(slot.staging_free)  # the last H2D copy out of this staging buffer ended
            for t in block.unique():  # disk -> pinned RAM, off the GPU's path: preadv, or the map as a fallback
                dest = self._view(slot.staging, t)
                if self.reader is None or not self.reader.read_mapped_into(t.host, dest):
                    dest.copy_(t.host)
            for t in block.unique():
                self.backend.copy(self._view(slot.buffer, t), self._view(slot.staging, t), side)
            slot.ready = self.backend.record(side)
            slot.staging_free = slot.ready

        slot.pending = self._reader.submit(stage_then_copy)

    @staticmethod
    def _view(buf: torch.Tensor, t: StreamedTensor) -> torch.Tensor:
        return buf[t.offset : t.offset + t.nbytes].view(t.host.dtype).view(t.host.shape)

    # -- hooks -----------------------------------------------------------------------------------------------
    def before(self, i: int) -> None:
        n = len(self.slots)
        s = self._slot_holding(i)
        if s is None:  # nothing prefetched this block (first call, or an order the streamer had not seen)
            self.sync_loads += 1
            s = self._free_slot(0 if self._cur_slot is None else (self._cur_slot + 1) % n)
            if s is None:
                raise RuntimeError(f"all {n} streaming slots are in use by running blocks; blocks must not nest")
            self._issue(i, s)
        slot = self.slots[s]
        self._cur_slot = s
        if slot.pending is not None:
            slot.pending.result()
            slot.pending = None
        self._running.add(s)  # from here until after(i), nothing may be copied into this slot
        self.backend.wait(self.backend.compute_stream(), slot.ready)
        for t in self.blocks[i].tensors:
            view = self._view(slot.buffer, t)
            if t.is_param:
                t.module._parameters[t.leaf] = torch.nn.Parameter(view, requires_grad=False)
            else:
                t.module._buffers[t.leaf] = view
        if self._last is not None:
            self.next_of[self._last] = i
        elif self._first is None:
            self._first = i
        self._last = i
        if n > 1:
            nxt = self.next_of.get(i, (i + 1) % len(self.blocks))
            if nxt != i and self._slot_holding(nxt) is None:
                target = self._free_slot((s + 1) % n)
                if target is not None:
                    self._issue(nxt, target)

    def _free_slot(self, start: int) -> int | None:
        """The first slot from ``start`` on whose block is not running now."""
        n = len(self.slots)
        for k in range(n):
            s = (start + k) % n
            if s not in self._running:
                return s
        return None

    def after(self, i: int, failed: bool = False) -> None:
        """Release block ``i``'s slot and put its host tensors back. Runs also when the block raised (an OOM):
        otherwise the slot stayed "running" and no later forward could prefetch into it. After a failure the
        forward is over, so nothing is learned about what follows ``i``, and the forward's first block is
        prefetched again for the next request."""
        s = self.where.get(i)
        if s is not None:
            self._running.discard(s)
            self.slots[s].done = self.backend.record(self.backend.compute_stream())
        for t in self.blocks[i].tensors:
            if t.is_param:
                t.module._parameters[t.leaf] = torch.nn.Parameter(t.host, requires_grad=False)
            else:
                t.module._buffers[t.leaf] = t.host
        if failed:
            self._last = None
            first = self._first
            if first is not None and first != i and self._slot_holding(first) is None and len(self.slots) > 1:
                target = self._free_slot(0 if s is None else s)  # the failed block's slot is free now
                if target is not None:
                    self._issue(first, target)

    def _after_hook(self, i: int):
        def hook(module, args, output):
            # always_call: torch runs this from its exception handler too, with output None
            self.after(i, failed=output is None and sys.exc_info()[0] is not None)

        return hook

    def install(self) -> None:
        for i, block in enumerate(self.blocks):
            self.handles.append(block.module.register_forward_pre_hook(lambda m, a, i=i: self.before(i)))
            self.handles.append(block.module.register_forward_hook(self._after_hook(i), always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=True)


def _units(model: torch.nn.Module, key: str, keys: list[str]) -> tuple[list[tuple[str, torch.nn.Module]], list[str]]:
    """Split device-map entry ``key`` into modules that contain no other entry (so blocks never nest).

    Returns (unit name, module) pairs in registration order and the names of modules whose *own* tensors belong
    to ``key`` but that also contain other entries (their few direct tensors are kept resident instead).
    """
    owner = _submodule_or_none(model, key)
    if owner is None:  # a single-tensor entry: its owning module is the unit
        parent = key.rpartition(".")[0]
        return [(parent, model.get_submodule(parent))], []
    nested = [k for k in keys if k != key and (key == "" or k.startswith(key + "."))]
    if not nested:
        return [(key, owner)], []
    return _units_below(key, owner, nested, keys)


def _units_below(
    path: str, module: torch.nn.Module, nested: list[str], keys: list[str]
) -> tuple[list[tuple[str, torch.nn.Module]], list[str]]:
    """``module`` (named ``path``, ``""`` for the root) split at the entries nested in it: children that hold no
    entry are units; ``path`` and every module on the way down to a nested entry keep their own tensors resident."""
    units: list[tuple[str, torch.nn.Module]] = []
    residual = [path]
    for child_name, child in module.named_children():
        p = f"{path}.{child_name}" if path else child_name
        if p in keys:
            continue  # its own entry
        if any(k.startswith(p + ".") for k in nested):
            u, r = _units_below(p, child, nested, keys)
            units += u
            residual += r
        else:
            units.append((p, child))
    return units, residual


def build_blocks(
    model: torch.nn.Module,
    entries: list[str],
    placement: Mapping[str, DeviceId],
    device_map: Mapping[str, DeviceId],
    host_lookups: Collection[torch.nn.Module] = (),
) -> tuple[list[StreamedBlock], list[tuple[torch.nn.Module, str]]]:
    """StreamedBlocks for every offloaded entry, in module order, never nested; plus tensors to keep resident.

    A tensor belongs to the block of the entry that places it (``placement``); tensors that are already off the
    CPU (non-persistent buffers built on the execution device) are not streamed, nor are the embeddings that run
    on the host (``host_lookups``, see :func:`host_lookup_modules`).
    """
    skip = {id(m) for m in host_lookups}
    keys = list(device_map)
    blocks: list[StreamedBlock] = []
    resident: list[tuple[torch.nn.Module, str]] = []
    seen: set[int] = set()

    def collect(mod_name: str, mod: torch.nn.Module, key: str, recurse: bool) -> list[StreamedTensor]:
        out = []
        mods = mod.named_modules() if recurse else [("", mod)]
        for sub_name, sub in mods:
            prefix = ".".join(x for x in (mod_name, sub_name) if x)
            items = [(leaf, p, True) for leaf, p in sub._parameters.items()]
            items += [(leaf, b, False) for leaf, b in sub._buffers.items()]
            for leaf, t, is_param in items:
                full = f"{prefix}.{leaf}" if prefix else leaf
                if t is None or (id(sub), leaf) in seen or t.device.type != "cpu":
                    continue
                if full in placement and entry_of(full, device_map) != key:
                    continue
                seen.add((id(sub), leaf))
                out.append(StreamedTensor(sub, leaf, t.data if is_param else t, is_param=is_param))
        return out

    for key in entries:
        if device_map[key] not in ("cpu", "disk"):
            continue
        units, residual = _units(model, key, keys)
        for mod_name in residual:
            for t in collect(mod_name, model.get_submodule(mod_name), key, recurse=False):
                resident.append((t.module, t.leaf))
        for unit_name, unit in units:
            if id(unit) in skip:
                continue
            tensors = collect(unit_name, unit, key, recurse=True)
            if tensors:
                staged = any(not t.host.is_pinned() for t in tensors)
                blocks.append(StreamedBlock(unit_name, unit, tensors, staged=staged))
    return blocks, resident


def _submodule_or_none(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# Device alignment
# ---------------------------------------------------------------------------------------------------------------
def move_to(obj, device: torch.device):
    """Tensors inside args/kwargs/outputs moved to ``device``; caches and other objects untouched.

    Copies to a GPU are asynchronous (ordered on its stream before whatever uses them). Copies to the host are
    not: a ``non_blocking`` device-to-host copy returns before the bytes arrive, and the host would read them
    unsynchronised (the ids of a host embedding lookup, or an output handed back without a sync)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=device.type != "cpu") if obj.device != device else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(move_to(o, device) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: move_to(v, device) for k, v in obj.items()}
    return obj


def _cuda_device(index: int) -> torch.device:
    return torch.device("cuda", index)


def alignment_modules(model: torch.nn.Module, key: str, keys: list[str]) -> list[torch.nn.Module]:
    """The modules whose inputs must be moved to entry ``key``'s device: the entry's module, and, when other entries
    nest inside it, every piece split off around them. Those pieces (``model.norm`` and ``lm_head`` of
    ``{"": "cpu", "model.layers.0": 0}``) are called by a parent with inputs still on the previous entry's device;
    the root itself is aligned by the root hooks, never here."""
    mods = [module_for_entry(model, key)]
    if any(k != key and (key == "" or k.startswith(key + ".")) for k in keys):
        units, _residual = _units(model, key, keys)
        mods += [unit for _name, unit in units]
    return [m for m in mods if m is not model]


def host_lookup_modules(model: torch.nn.Module, device_map: Mapping[str, DeviceId]) -> list[torch.nn.Module]:
    """Embeddings placed on ``cpu`` or ``disk``, other than the output head: while GPUs compute they run on the host
    (and without GPUs, one on ``disk`` is never read ahead whole, :mod:`loaders.run.execution`).

    A lookup reads one row per token, and that is how the planner costs an offloaded embedding (its
    ``sequential+embeddings_on_cpu`` candidate against a resident GPU copy). Streaming the table instead copied all
    of it every forward (~1 GB per token for an 8B model). So the ids go to the host, the rows are gathered there
    (from pinned memory, or from the memory map for ``disk``: only the rows read are faulted in), and only the
    looked-up hidden states cross the link to the execution device."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Embedding) or mod is head or mod is model:
            continue
        weight = f"{name}.weight"
        try:
            dev = device_map[entry_of(weight, device_map)]
        except KeyError:
            continue
        if dev in ("cpu", "disk") and mod.weight.device.type == "cpu":
            out.append(mod)
    return out


def _run_on_host(module: torch.nn.Module, exec_device: torch.device) -> None:
    """Hooks that make ``module`` compute on the CPU, its output handed to ``exec_device``; its non-persistent
    buffers (Gemma's embedding scale), built on the execution device with the rest of an offloaded entry, come
    back to the CPU."""
    cpu = torch.device("cpu")
    for leaf, buf in list(module._buffers.items()):
        if buf is not None and buf.device != cpu:
            module._buffers[leaf] = buf.to(cpu)

    def inputs_to_host(mod, args, kwargs):
        return move_to(args, cpu), move_to(kwargs, cpu)

    def output_to_device(mod, args, output):
        return move_to(output, exec_device)

    module.register_forward_pre_hook(inputs_to_host, with_kwargs=True)
    module.register_forward_hook(output_to_device)


def install_gpu_execution(
    model: torch.nn.Module,
    device_map: Mapping[str, DeviceId],
    placement: Mapping[str, DeviceId],
    exec_device: torch.device,
    backend=None,
    gpu_device: Callable[[int], torch.device] = _cuda_device,
    reader: ShardReader | None = None,
) -> BlockStreamer | None:
    """Hooks for a model spread over GPUs (+ offloaded blocks streamed to ``exec_device``).

    ``backend`` defaults to CUDA on ``exec_device``; tests pass :class:`CpuBackend` with ``exec_device=cpu`` to
    run this exact wiring on a machine without GPUs, and ``gpu_device`` to stand other devices in for GPU ids.
    """
    entries = ordered_entries(model, device_map)
    keys = list(device_map)
    lookups = host_lookup_modules(model, device_map)
    on_host = {id(m) for m in lookups}
    for key in entries:
        dev = device_map[key]
        target = gpu_device(dev) if isinstance(dev, int) else exec_device

        def align(module, args, kwargs, target=target):
            return move_to(args, target), move_to(kwargs, target)

        for mod in alignment_modules(model, key, keys):
            if id(mod) not in on_host:
                mod.register_forward_pre_hook(align, with_kwargs=True)
    for mod in lookups:
        _run_on_host(mod, exec_device)

    def root_in(module, args, kwargs):
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        module._loadmaster_caller_device = first.device if first is not None else exec_device
        return None

    def root_out(module, args, output):
        caller = getattr(module, "_loadmaster_caller_device", exec_device)
        if hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
            output.logits = output.logits.to(caller)
            return output
        return move_to(output, caller)

    model.register_forward_pre_hook(root_in, with_kwargs=True)
    model.register_forward_hook(root_out)
    blocks, resident = build_blocks(model, entries, placement, device_map, lookups)
    for module, leaf in resident:  # the few tensors owned directly by a module that also contains other entries
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(
                module._parameters[leaf].data.to(exec_device), requires_grad=False
            )
        else:
            module._buffers[leaf] = module._buffers[leaf].to(exec_device)
    if lookups:
        log.info("embeddings looked up on the host: %s", ", ".join(type(m).__name__ for m in lookups))
    if not blocks:
        return None
    streamer = BlockStreamer(blocks, backend if backend is not None else CudaBackend(exec_device), reader=reader)
    streamer.install()
    model._loadmaster_streamer = streamer
    log.info("streaming %d offloaded blocks through 2 x %d bytes on %s", len(blocks), streamer.slot_bytes, exec_device)
    return streamer
