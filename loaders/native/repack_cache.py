"""A pre-quantized checkpoint's repacked layers, saved once as safetensors and mapped by every later load.

Why: GPTQ, AWQ and compressed-tensors integer layers are repacked at load into the native int4/int8 layouts
(:mod:`loaders.native.packed_formats`), which costs seconds (6.9 s for the 1B Llama's 154 GPTQ layers on two
cores), and a repacked copy lives in the process's anonymous memory, so a layer the plan put on disk would be
held in RAM the plan did not give it. With a folder (``cpu_quantized_dir``, as ``cpu_quantization`` saves its
weights), the repacked tensors are written there once, atomically, as ``repacked-<key>.safetensors``; the key
covers the checkpoint's shards (name, size, mtime), the layers and the layouts' version, so a changed checkpoint
is repacked again and never read stale. Every load, the first included, then takes the layers from that file's
memory map: disk layers are read from it as any disk weight is (their readahead follows the file), resident ones
fault in on first use and are locked as they do (:mod:`loaders.checkpoint.residency`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from loaders.checkpoint.index import ShardEntry
from loaders.checkpoint.shard_reader import ShardReader
from loaders.native import map_guard
from loaders.native.quantization import QuantizedCPULinear, cache_key, saved_header, write_saved
from planner.placement.sizing import cpu_quantized_layout

log = logging.getLogger(__name__)

#: The scheme name the file's metadata carries (``cpu_quantization``'s files carry ``int8`` or ``int4``).
SCHEME = "repacked"
#: The tensors a repacked layer holds, by the suffix saved under its name (zeros and perm where it has them).
SUFFIXES = ("qweight", "scales", "zeros", "perm")


@dataclass
class RepackCache:
    """Where a load saves and maps its repacked layers: ``folder``, keyed by ``checkpoint_files`` (path, size,
    mtime_ns); ``reader`` maps the file (the load's own reader, so the disk readahead can advise the file)."""

    folder: Path
    checkpoint_files: list[tuple[str, int, int]]
    reader: ShardReader

    def path_and_key(self, layers: list[str]) -> tuple[Path, str]:
        key = cache_key(self.checkpoint_files, SCHEME, sorted(layers))
        return Path(self.folder) / f"{SCHEME}-{key}.safetensors", key

    def entries(self, layers: list[str]) -> dict[str, dict[str, ShardEntry]] | None:
        """The saved tensors for this load's ``layers``, by layer and suffix; None when no file is there for it
        (absent, unreadable, or made for another checkpoint or version: the log says which)."""
        path, key = self.path_and_key(layers)
        header = saved_header(path, key, SCHEME, "repacked")
        if header is None:
            return None
        found: dict[str, dict[str, ShardEntry]] = {}
        for name, t in header.tensors.items():
            layer, _, suffix = name.rpartition(".")
            entry = ShardEntry(name, str(path), getattr(torch, t.dtype), tuple(t.shape), t.offset, t.offset + t.nbytes)
            found.setdefault(layer, {})[suffix] = entry
        return found

    def save(self, layers: list[str], repacked: dict[str, QuantizedCPULinear]) -> dict[str, dict[str, ShardEntry]]:
        """Write ``repacked`` (layer name -> its repacked form) as this load's file; its entries, as ``entries``."""
        path, key = self.path_and_key(layers)
        tensors = {f"{name}.{s}": t for name, lin in repacked.items() for s, t in layer_tensors(lin).items()}
        write_saved(path, key, SCHEME, tensors)
        log.info("saved %d repacked layers to %s", len(repacked), path)
        return self.entries(layers) or {}

    def layer(self, name: str, saved: dict[str, ShardEntry], bias: torch.Tensor | None, k: int, n: int):
        """Layer ``name`` ([n, k]) built on the maps of its saved tensors; None (logged) when they are not the
        layout the kernels take, so the caller repacks it instead."""
        q = saved.get("qweight")
        scheme = "int8" if q is not None and q.dtype is torch.int8 else "int4"
        if not _layout_holds(saved, scheme, n, k):
            path = next(iter(saved.values())).file
            log.warning("ignoring the repacked %s in %s: its tensors are not the native layout", name, path)
            return None
        mm = self.reader.mapping(q.file)
        map_guard.guard(mm)  # a truncated file then fails a step, not the process
        t = {s: self.reader.mapped(e) for s, e in saved.items()}
        return QuantizedCPULinear(scheme, k, n, t["qweight"], t["scales"], bias, t.get("zeros"), t.get("perm"))


def layer_tensors(lin: QuantizedCPULinear) -> dict[str, torch.Tensor]:
    """The tensors that rebuild ``lin`` (its bias stays the checkpoint's), by suffix."""
    out = {"qweight": lin.qweight, "scales": lin.scales}
    if lin.zeros is not None:
        out["zeros"] = lin.zeros
    if lin.perm is not None:
        out["perm"] = lin.perm
    return {s: t.contiguous() for s, t in out.items()}


def _layout_holds(saved: dict[str, ShardEntry], scheme: str, n: int, k: int) -> bool:
    lay = cpu_quantized_layout(n, k, scheme)
    want = {"qweight": (lay.qweight_shape, lay.qweight_dtype), "scales": (lay.scales_shape, lay.scales_dtype)}
    if scheme == "int4":
        want["zeros"] = (lay.scales_shape, "float16")
    want["perm"] = ((k,), "int64")
    if set(saved) - set(want) or not {"qweight", "scales"} <= set(saved):
        return False
    return all(tuple(e.shape) == tuple(want[s][0]) and e.dtype is getattr(torch, want[s][1]) for s, e in saved.items())
