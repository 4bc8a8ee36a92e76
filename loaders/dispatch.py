"""Making a loaded model run across its devices, adding hooks only where they do something.

* Host without GPUs: ``"cpu"`` and ``"disk"`` modules run as plain modules (disk tensors are memory maps, so the
  kernel pages them in). The only hook is a readahead on each disk block that asks the kernel to start reading
  the *next* disk block's bytes (``madvise(WILLNEED)``), so cold-cache decoding overlaps reads with compute; a
  few-page ``mincore`` probe skips the advice when the bytes are already cached.
* With GPUs: modules on a GPU get their inputs moved to that GPU at device boundaries; the root's outputs go
  back to the caller's device; offloaded blocks are streamed by :class:`loaders.streaming.BlockStreamer`.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Mapping

import torch

from loaders.device_map import entry_of
from planner.types import DeviceId

log = logging.getLogger(__name__)


def ordered_entries(model: torch.nn.Module, device_map: Mapping[str, DeviceId]) -> list[str]:
    """Device-map keys in module order (the order blocks run in for decoder stacks)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    pos = {}
    for key in device_map:
        mod_key = key
        while mod_key and mod_key not in order:
            mod_key = mod_key.rpartition(".")[0]
        pos[key] = order.get(mod_key, 0)
    return sorted(device_map, key=lambda k: (pos[k], k))


def module_for_entry(model: torch.nn.Module, key: str) -> torch.nn.Module:
    """The module a device-map key names; for a single-tensor key, the module owning that tensor."""
    try:
        return model.get_submodule(key)
    except AttributeError:
        return model.get_submodule(key.rpartition(".")[0])


class DiskReadahead:
    """Forward pre-hooks that, as disk block i starts, ask the kernel to read its bytes and block i+1's ahead."""

    def __init__(self, reader, blocks: list[tuple[str, list[tuple[str, int, int]]]]):
        self.reader = reader
        self.blocks = blocks
        self.handles = []

    def install(self, model: torch.nn.Module) -> None:
        for i, (key, own) in enumerate(self.blocks):
            nxt = self.blocks[(i + 1) % len(self.blocks)][1]
            mod = module_for_entry(model, key)
            # Its own bytes first (a no-op when cached; after eviction it turns 4 KiB faults into large reads),
            # then the next block's, which the kernel reads while this block computes.
            ranges = own + nxt if len(self.blocks) > 1 else own
            self.handles.append(mod.register_forward_pre_hook(self._hook(ranges)))

    def _hook(self, ranges):
        reader = self.reader

        def prefetch_next(module, args):
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


def _merge_ranges(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    for path, s, e in sorted(ranges):
        if out and out[-1][0] == path and s <= out[-1][2] + 4096:
            out[-1] = (path, out[-1][1], max(out[-1][2], e))
        else:
            out.append((path, s, e))
    return out


def dispatch(model: torch.nn.Module, device_map: Mapping[str, DeviceId], placement: Mapping[str, DeviceId],
             materializer, exec_device: torch.device) -> None:
    """Install the hooks this placement needs (none for an all-CPU model)."""
    if exec_device.type == "cpu":
        by_entry: dict[str, list] = OrderedDict()
        for name, rng in materializer.disk_ranges.items():
            by_entry.setdefault(entry_of(name, device_map), []).append(rng)
        if by_entry:
            order = ordered_entries(model, device_map)
            blocks = [(k, _merge_ranges(by_entry[k])) for k in order if k in by_entry]
            ra = DiskReadahead(materializer.reader, blocks)
            ra.install(model)
            model._loadmaster_readahead = ra
        model._loadmaster_reader = materializer.reader  # keeps the shard maps alive with the model
        return
    from loaders.streaming import install_gpu_execution

    install_gpu_execution(model, device_map, placement, materializer, exec_device)
    model._loadmaster_reader = materializer.reader
