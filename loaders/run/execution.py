"""Execution: making a placed model run across its devices, applied explicitly after placement.

* Host without GPUs: ``"cpu"`` and ``"disk"`` modules run as plain modules (disk tensors are memory maps, guarded
  by :mod:`loaders.native.map_guard` against a shard truncated under the process); the only hooks are
  :class:`loaders.run.readahead.DiskReadahead`'s on disk blocks. Linear layers are then quantized when asked
  (:mod:`loaders.native.quantization`), and small linear products run on the native CPU kernels (:mod:`loaders.native.linear`)
  where they build, as does decode steps' attention (:mod:`loaders.native.attention`).
* With GPUs: modules on a GPU get their inputs moved to that GPU at device boundaries, the root's outputs go back to
  the caller's device, and offloaded blocks are streamed (:mod:`loaders.run.streaming`); routed experts the plan puts
  on the CPU, and the layers its ``cpu_compute`` lists, compute there (:mod:`loaders.run.cpu_experts`), on the native
  CPU kernels where they build (``cpu_kernels``); nothing else is switched to them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loaders.checkpoint.device_order import cpu_compute_entries, entry_of, module_for_entry, ordered_entries
from loaders.checkpoint.placement import PlacedModel
from loaders.native import map_guard
from loaders.native.attention import use_native_attention
from loaders.native.experts import install_expert_kernels
from loaders.native.gpt_oss_experts import install_transposed_experts
from loaders.native.linear import use_native_linears
from loaders.native.packed_formats import PackedStats, repack_packed_linears
from loaders.native.quantization import QuantizationStats, quantize_cpu_linears
from loaders.native.repack_cache import RepackCache
from loaders.run.cpu_experts import install_gpu_execution_with_cpu_experts, native_cpu_modules
from loaders.run.expert_reads import SparseExpertReads, disk_experts
from loaders.run.readahead import DiskReadahead, merge_ranges
from loaders.run.streaming import host_lookup_modules
from planner.errors import PlanError
from planner.hardware.device_inventory import host_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Execution:
    """What execution changed: linear layers (and routed-experts modules computed on the CPU beside GPUs) switched to
    the native kernels, and CPU quantization's report."""

    native_linears: int = 0
    cpu_quantization: QuantizationStats | None = None
    #: Whether decode steps' attention runs on the native kernel (:mod:`loaders.native.attention`).
    native_attention: bool = False


def apply_execution(
    placed: PlacedModel,
    cpu_kernels: str = "auto",
    *,
    cpu_quantization: str | None = None,
    cpu_quantized_dir: Path | None = None,
    checkpoint_files: Sequence[tuple[str, int, int]] = (),
    disk_cached: bool | None = None,
) -> Execution:
    """Install the hooks the placement needs; on a CPU-executed model, quantize its linears first when
    ``cpu_quantization`` asks (:mod:`loaders.native.quantization`; ``checkpoint_files`` (path, size, mtime_ns) key the saved
    copy in ``cpu_quantized_dir``), then switch them to the native kernels (``cpu_kernels``: "auto", "native" or
    "torch"). ``disk_cached``: the plan's verdict on its disk share (:attr:`~planner.types.Prediction.disk_cached`);
    None (a device map without a plan) decides from the memory available now."""
    model, device_map = placed.model, placed.device_map
    model._loadmaster_reader = placed.reader  # keeps the shard maps alive with the model
    for mm in list(placed.reader.maps.values()):  # read in place: a truncated shard then fails a step, not the process
        map_guard.guard(mm)
    cache = RepackCache(cpu_quantized_dir, list(checkpoint_files), placed.reader) if cpu_quantized_dir else None
    on_gpus = placed.execution_device.type != "cpu"
    packed = repack_packed_linears(
        model,
        _compute_dtype(model),
        native=not on_gpus,
        cache=cache,
        disk_tensors=placed.disk_ranges,
        cpu_computed=cpu_compute_entries(model, device_map, placed.cpu_compute) if on_gpus else (),
    )
    disk_ranges = dict(placed.disk_ranges)
    if packed is not None:
        model._loadmaster_packed_stats = packed
        disk_ranges = _repacked_disk_ranges(disk_ranges, packed)
    if placed.execution_device.type != "cpu":
        if cpu_quantization:
            raise PlanError(
                f"cpu_quantization={cpu_quantization!r} quantizes layers that compute on the CPU, "
                "but this device map computes on a GPU. Use quantization='int8' or 'nf4' "
                "(bitsandbytes) for GPU layers."
            )
        install_gpu_execution_with_cpu_experts(
            model,
            device_map,
            placed.tensor_devices,
            placed.execution_device,
            cpu_compute=placed.cpu_compute,
            cpu_kernels=cpu_kernels,
            reader=placed.reader,
        )
        return Execution(native_cpu_modules(model))
    _install_disk_reads(model, device_map, disk_ranges, placed.reader, disk_cached)
    quant_stats = None
    if cpu_quantization:
        quant_stats = quantize_cpu_linears(
            model,
            cpu_quantization,
            checkpoint_files=list(checkpoint_files),
            save_dir=cpu_quantized_dir,
            release=lambda weight: _give_back(placed.reader, weight),
        )
    native = use_native_linears(model, cpu_kernels)
    native += install_expert_kernels(
        [m for name, m in model.named_modules() if name.endswith(".experts")], cpu_kernels
    )  # routed experts, as beside GPUs: a decode step hands each a few rows, the kernels' case
    if cpu_kernels != "torch":  # gpt-oss's float experts, laid out for the kernel (those on disk stay as stored)
        on_disk = {n for n, _ in model.named_modules() if placed.tensor_devices.get(f"{n}.gate_up_proj") == "disk"}
        native += install_transposed_experts(model, on_disk, release=lambda w: _give_back(placed.reader, w))
    attention = cpu_kernels != "torch" and use_native_attention(model)
    return Execution(native, quant_stats, native_attention=attention)


def _install_disk_reads(
    model, device_map, disk_ranges: dict[str, tuple[str, int, int]], reader, disk_cached: bool | None
) -> None:
    """Readahead of the disk blocks (:mod:`loaders.run.readahead`), less what is read sparsely: an embedding's
    rows (a lookup faults in the rows it reads) and routed experts, read per hit expert
    (:mod:`loaders.run.expert_reads`). Both give their pages back after use (drop-behind) where the disk share does
    not stay cached: as the plan took it (``disk_cached``), else as :func:`_disk_outgrows_cache` judges now."""
    experts = disk_experts(model, disk_ranges)
    fused = {r.tensor: (r.path, r.start, r.start + r.per_expert * n) for n, rs in experts.values() for r in rs}
    by_entry: dict[str, list] = OrderedDict()
    lookups = {id(m) for m in host_lookup_modules(model, device_map)}
    for name, rng in disk_ranges.items():
        entry = entry_of(name, device_map)
        if id(module_for_entry(model, entry)) in lookups:
            continue  # an embedding on disk: a lookup faults in the rows it reads, no more; never read ahead whole
        if name not in fused:
            by_entry.setdefault(entry, []).append(rng)
    blocks = [(k, merge_ranges(by_entry[k])) for k in ordered_entries(model, device_map) if k in by_entry]
    if disk_cached is None:
        drop_behind = _disk_outgrows_cache([r for _, rs in blocks for r in rs] + list(fused.values()))
    else:
        drop_behind = not disk_cached
    if blocks or experts:
        log.info(
            "disk pages %s (%s)",
            "given back after use: the disk share outgrows the page cache" if drop_behind else "kept in the page cache",
            "as the plan took it" if disk_cached is not None else "judged from the memory available now",
        )
    if blocks:
        readahead = DiskReadahead(reader, blocks, drop_behind=drop_behind)
        readahead.install(model)
        model._loadmaster_readahead = readahead
    if experts:
        reads = SparseExpertReads(reader, experts, drop_behind)
        reads.install(model)
        model._loadmaster_expert_reads = reads
        log.info("%d experts modules on disk are read per hit expert", len(experts))


def _give_back(reader, weight: torch.Tensor) -> None:
    """Drop a quantized layer's float weight from the page cache where it was a map of a shard (best effort)."""
    where = reader.range_of(weight)
    if where is not None:
        reader.drop_mapped(*where)


def _repacked_disk_ranges(
    disk_ranges: dict[str, tuple[str, int, int]], packed: PackedStats
) -> dict[str, tuple[str, int, int]]:
    """The disk tensors' ranges once layers are repacked: a repacked disk layer no longer reads its stored tensors,
    only its saved copy's ranges where it reads one (none where it was repacked into memory)."""
    kept = {n: r for n, r in disk_ranges.items() if n.rpartition(".")[0] not in packed.disk_layers}
    kept.update(packed.file_ranges)
    return kept


def _disk_outgrows_cache(ranges: list[tuple[str, int, int]]) -> bool:
    """For a device map without a plan: whether the disk tensors (their byte ``ranges``) cannot stay in the page
    cache between tokens: more bytes than half the memory left now that the resident weights are in (the KV cache
    and activations are still to come; a plan knows them, and says). Then every disk page is read again each token
    anyway, and dropping each block behind it (:class:`DiskReadahead`) spares the box reclaim; otherwise the pages
    stay and later tokens read them at memory speed."""
    disk = sum(end - start for _, start, end in ranges)
    return disk > host_memory().available // 2


def _compute_dtype(model) -> torch.dtype:
    """The dtype the model computes in: its input embedding's."""
    try:
        return model.get_input_embeddings().weight.dtype
    except (AttributeError, NotImplementedError):
        return torch.float32


__all__ = ["Execution", "apply_execution"]
