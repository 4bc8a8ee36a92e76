"""Placement: the checkpoint's tensors put on the devices a device map names, in a model built once, on the meta
device, by the planner's :func:`planner.model.skeleton.describe_checkpoint`. No hook is installed here: what runs where
is :mod:`loaders.run.execution`'s, applied after placement.

The steps: the one validator (:func:`planner.placement.hf_device_map.assign_devices`) gives every tensor its device; the one key
mapping (:mod:`planner.model.checkpoint_keys`, applied by :mod:`loaders.checkpoint.layout`) says which checkpoint keys
fill it, or the checkpoint is refused before any weight is allocated; :class:`loaders.checkpoint.materialize.Materializer`
reads each tensor onto its device (zero-copy maps for ``"disk"``, the offload folder for converted disk tensors);
then non-persistent buffers are computed on their devices and tied weights re-tied.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loaders.checkpoint.device_order import execution_device, host_computed
from loaders.checkpoint.index import CheckpointIndex
from loaders.checkpoint.layout import resolve_sources
from loaders.checkpoint.load_progress import LoadStats, ProgressReporter
from loaders.checkpoint.materialize import Materializer
from loaders.checkpoint.model_tensors import init_non_persistent_buffers, set_tensor, tie_weights
from loaders.checkpoint.shard_reader import ShardReader
from loaders.errors import CheckpointError
from planner.errors import PlanError
from planner.model.skeleton import CheckpointModel
from planner.placement.hf_device_map import assign_devices, check_tied_groups
from planner.types import DeviceId


@dataclass
class PlacedModel:
    """A model whose every tensor sits on its device, before any execution hook: what placement hands execution."""

    model: torch.nn.Module
    device_map: dict[str, DeviceId]
    #: Every parameter and buffer name (tied aliases included) -> its device.
    tensor_devices: dict[str, DeviceId]
    #: Where offloaded blocks compute: the lowest GPU of the map, or the CPU.
    execution_device: torch.device
    #: The shard maps the CPU and disk tensors are views of (kept alive with the model).
    reader: ShardReader
    #: Disk-served tensor name -> (file, start, end) of its backing bytes, for readahead.
    disk_ranges: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    stats: LoadStats = field(default_factory=LoadStats)
    #: The plan's keys of modules that compute on the CPU while GPUs compute the rest (``Plan.cpu_compute``).
    cpu_compute: tuple[str, ...] = ()


def _keep_fp32_patterns(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    pats = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        pats += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return pats


def _cpu_linear_weights(
    model: torch.nn.Module, devices: Mapping[str, DeviceId], tied_groups: tuple[tuple[str, ...], ...]
) -> set[str]:
    """The weights of the linear layers placed on the CPU, tied ones excepted (another module reads them too)."""
    tied = {name for group in tied_groups for name in group}
    return {
        f"{name}.weight"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and devices.get(f"{name}.weight") == "cpu" and f"{name}.weight" not in tied
    }


def place(
    described: CheckpointModel,
    index: CheckpointIndex,
    device_map: Mapping[str, DeviceId],
    run_dtype: torch.dtype,
    reporter: ProgressReporter,
    *,
    model_path: Path,
    offload_folder: Path | None = None,
    cpu_compute: Collection[str] = (),
    quantized_on_cpu: bool = False,
) -> PlacedModel:
    """Put every tensor of ``described.model`` (built on the meta device in ``run_dtype``) where the map says.

    ``cpu_compute``: the plan's keys of modules that compute on the CPU (``Plan.cpu_compute``); with the routed
    experts a map puts on the CPU, their tensors are never pinned, since they never cross to a GPU.
    ``quantized_on_cpu``: the CPU's linear layers are quantized next (``cpu_quantization``), so their weights are
    handed over as maps of the shards, never copied whole (:meth:`Materializer.materialize`)."""
    model = described.model
    skeleton = described.skeleton
    tied_targets = {alias for group in skeleton.tied_groups for alias in group[1:]}
    specs = skeleton.tensors()
    wanted = {t.name: t.shape for t in specs if t.kind != "buffer_nonpersistent"}
    np_bufs = [t.name for t in specs if t.kind == "buffer_nonpersistent"]
    ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    ignore_unexpected += [r"rotary_emb\.inv_freq$"] + [f"^{re.escape(t)}$" for t in tied_targets]
    sources = resolve_sources(
        wanted,
        index,
        base_prefix=getattr(model, "base_model_prefix", ""),
        ignore_unexpected=ignore_unexpected,
        ignore_missing=getattr(model, "_keys_to_ignore_on_load_missing", None) or (),
    )
    all_names = list(wanted) + np_bufs + sorted(tied_targets)
    devices = assign_devices(all_names, device_map, (n for n, _ in model.named_modules()))
    check_tied_groups(skeleton.tied_groups, devices.get)
    has_gpu = any(isinstance(d, int) for d in devices.values())
    if has_gpu and not torch.cuda.is_available():
        raise PlanError(
            "The device map places modules on a GPU but torch sees no CUDA device here. "
            "Plan for this machine (device_map='auto') or use 'cpu'/'disk'."
        )
    if has_gpu:
        check_bf16_support(sorted({d for d in devices.values() if isinstance(d, int)}), run_dtype)
    exec_dev = execution_device(device_map)

    reporter.set_phase("loading")
    mat = Materializer(
        index,
        run_dtype,
        _keep_fp32_patterns(model, run_dtype),
        reporter,
        offload_folder=offload_folder,
        model_path=model_path,
        has_gpu=has_gpu,
        keep_stored=[n for n, m in model.named_modules() if getattr(m, "loadmaster_packed", False)],
        mapped_for_quantization=_cpu_linear_weights(model, devices, skeleton.tied_groups) if quantized_on_cpu else (),
    )
    unpinned = host_computed(model, device_map, cpu_compute, sources) if has_gpu else set()
    for name, t in mat.materialize(sources, {n: devices[n] for n in sources}, unpinned).items():
        set_tensor(model, name, t)
    buf_devices = {n: (torch.device("cuda", devices[n]) if isinstance(devices[n], int) else exec_dev) for n in np_bufs}
    init_non_persistent_buffers(model, buf_devices)
    tie_weights(model)
    _check_materialized(model)
    return PlacedModel(
        model, dict(device_map), devices, exec_dev, mat.reader, mat.disk_ranges, mat.stats, tuple(cpu_compute)
    )


def check_bf16_support(
    gpus: list[int],
    dtype: torch.dtype,
    capability: Callable[[int], tuple[int, int]] | None = None,
    name: Callable[[int], str] | None = None,
) -> None:
    """Refuse bfloat16 on a GPU older than Ampere (compute capability < 8.0: V100, T4, RTX 20xx). Such GPUs have no
    bf16 arithmetic; torch emulates some of it and fails on the rest (cuBLAS), so a load would either fail midway
    or run several times slower. float16 has the same size and is native there."""
    if dtype != torch.bfloat16 or not gpus:
        return
    capability = capability or torch.cuda.get_device_capability
    name = name or torch.cuda.get_device_name
    old = [(g, capability(g)) for g in gpus]
    old = [(g, cc) for g, cc in old if cc < (8, 0)]
    if old:
        which = ", ".join(f"GPU {g} ({name(g)}, compute capability {cc[0]}.{cc[1]})" for g, cc in old)
        raise PlanError(
            f"bfloat16 needs compute capability 8.0 (Ampere) or newer; {which} lacks it. "
            "Load in float16 instead (--dtype float16, dtype='float16'): the same memory, native on these GPUs."
        )


def _check_materialized(model: torch.nn.Module) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(
            f"Tensors left without data after loading: {left[:10]}. This is a loader bug; "
            "please report it with the model's config.json."
        )


__all__ = ["PlacedModel", "check_bf16_support", "place"]
