"""``load_checkpoint`` / ``load_model``: a checkpoint directory + a device map (or Plan) -> a ready transformers model.

The steps, each in its own room:

1. ``safetensors_index``: read and validate every shard header (nothing is allocated before this passes);
2. the planner's ``describe_checkpoint``: the model's Skeleton and its meta model, built once (or handed in by a
   caller that planned with it);
3. the device map: a Plan is checked against the checkpoint's fingerprint and obeyed; a strategy name is planned
   from the same Skeleton; a dict is taken as is;
4. ``placement``: every tensor on its device (validated map, checkpoint key mapping, materialisation);
5. ``execution``: hooks, streaming and native kernels, applied to the placed model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loaders.checkpoint.bitsandbytes_load import load_quantized
from loaders.checkpoint.device_order import normalize_map
from loaders.checkpoint.index import CheckpointIndex
from loaders.checkpoint.load_progress import LoadProgress, LoadStats, ProgressReporter, peak_rss_bytes, reset_peak_rss
from loaders.checkpoint.placement import place
from loaders.checkpoint.residency import CPU_RESIDENCY_CHOICES, lock_resident
from loaders.errors import CheckpointError
from loaders.native.linear import CPU_KERNEL_CHOICES
from loaders.native.quantization import check_cpu_quantization
from loaders.run.execution import apply_execution
from planner.api import plan as make_plan
from planner.errors import PlanError
from planner.model.fingerprint import check_plan_fingerprint
from planner.model.model_ref import HubRef, cached_snapshot_of
from planner.model.skeleton import CheckpointModel, describe_checkpoint
from planner.placement.inputs import make_workload
from planner.placement.sizing import normalize_dtype
from planner.placement.solve import STRATEGY_NAMES
from planner.types import DeviceId, Plan, Skeleton

log = logging.getLogger(__name__)

DeviceMapArg = str | Mapping[str, object] | Plan | None
Source = str | os.PathLike | CheckpointModel


@dataclass
class LoadResult:
    """What a load produced, typed: the ready model, the map it obeys, the plan (if any) and what it cost.

    ``stats.bytes_per_device`` is where the weights went by *placement* ("cpu", "disk", "cuda:N"): disk-offloaded
    tensors are memory maps that torch reports as CPU tensors, so this, not the tensors' devices, is the truth.
    """

    model: torch.nn.Module
    device_map: dict[str, DeviceId]
    plan: Plan | None
    stats: LoadStats
    skeleton: Skeleton


def _dtype_name(dtype) -> str | None:
    """The user's dtype (a torch.dtype or any spelling the planner reads) as a dtype name; None for "default"."""
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        return None
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return normalize_dtype(str(dtype), "float32")


def _planned_cpu_quantization(the_plan: Plan, asked: str | None) -> str | None:
    """The CPU quantization to load a Plan with: the one it was sized for. Asking for another is refused, since
    the plan's budgets would not be the bytes loaded."""
    planned = the_plan.workload.cpu_quantization
    if asked is not None and planned is not None and asked != planned:
        raise PlanError(
            f"cpu_quantization={asked!r}, but the plan was made for cpu_quantization={planned!r}: "
            f"load with {planned!r}, or plan again with {asked!r}."
        )
    return asked if asked is not None else planned


def resolve_device_map(
    skeleton: Skeleton,
    device_map: DeviceMapArg,
    *,
    max_memory,
    dtype: str,
    quantization,
    workload,
    offload_folder=None,
    cpu_quantization: str | None = None,
) -> tuple[dict[str, DeviceId], Plan | None]:
    """The device map to obey. A Plan is taken as is; a strategy name is planned from ``skeleton``; a dict (or a
    single device) is normalised, and validated against the model at placement."""
    if isinstance(device_map, Plan):
        return normalize_map(device_map.device_map), device_map
    if device_map is None:
        return {"": "cpu"}, None
    if isinstance(device_map, str):
        if device_map not in STRATEGY_NAMES:
            if device_map in ("cpu", "disk") or device_map.startswith("cuda") or device_map.isdigit():
                return normalize_map({"": device_map}), None
            raise PlanError(
                f"Unknown device_map strategy {device_map!r}: use one of {', '.join(STRATEGY_NAMES)}, "
                "a dict of module -> device, or a Plan."
            )
        p = make_plan(
            skeleton,
            max_memory=max_memory,
            strategy=device_map,
            dtype=dtype,
            quantization=quantization,
            offload_folder=offload_folder,
            cpu_quantization=cpu_quantization,
            **workload,
        )
        return normalize_map(p.device_map), p
    if isinstance(device_map, Mapping):
        return normalize_map(device_map), None
    raise PlanError(f"device_map must be a strategy name, a dict or a Plan, not {type(device_map).__name__}.")


def load_checkpoint(
    source: Source,
    device_map: DeviceMapArg = "auto",
    max_memory=None,
    dtype=None,
    quantization: str | None = None,
    offload_folder: str | os.PathLike | None = None,
    *,
    progress: Callable[[LoadProgress], None] | None = None,
    show_progress: bool = True,
    cpu_kernels: str = "auto",
    cpu_quantization: str | None = None,
    cpu_quantized_dir: str | os.PathLike | None = None,
    cpu_residency: str = "lock",
    **workload,
) -> LoadResult:
    """Load a checkpoint onto the devices a device map (or Plan) names; see :func:`load_model` for the arguments.

    ``source`` is a checkpoint directory, or the :class:`~planner.model.skeleton.CheckpointModel` a caller already
    described (and planned with): its meta model is filled in place rather than built again.
    """
    if cpu_kernels not in CPU_KERNEL_CHOICES:
        raise PlanError(f"cpu_kernels={cpu_kernels!r} is not one of {', '.join(CPU_KERNEL_CHOICES)}.")
    if cpu_residency not in CPU_RESIDENCY_CHOICES:
        raise PlanError(f"cpu_residency={cpu_residency!r} is not one of {', '.join(CPU_RESIDENCY_CHOICES)}.")
    t0 = time.perf_counter()
    reset_peak_rss()
    given = _dtype_name(dtype)
    if isinstance(device_map, Plan):
        given = given or device_map.workload.dtype
        quantization = quantization if quantization is not None else device_map.workload.quantization
        cpu_quantization = _planned_cpu_quantization(device_map, cpu_quantization)
    if isinstance(source, CheckpointModel):
        root = Path(source.headers.directory)
        index = CheckpointIndex.from_headers(source.headers)
    else:
        root, hub = _local_checkpoint(source, device_map)
        root = root.parent if root.is_file() else root
        index = CheckpointIndex.open(root)
    reporter = ProgressReporter(index.total_bytes(), progress, show_bar=show_progress)
    try:
        reporter.set_phase("building")
        described = (
            source if isinstance(source, CheckpointModel) else describe_checkpoint(root, given, headers=index.headers)
        )
        if not isinstance(source, CheckpointModel) and hub is not None:  # a plan made here names the Hub commit
            described = replace(
                described, skeleton=replace(described.skeleton, name=hub.repo_id, revision=hub.revision)
            )
        run = make_workload(described.skeleton, given).dtype  # the planner's default when none is given
        check_cpu_quantization(cpu_quantization, quantization, cpu_quantized_dir, getattr(torch, run))
        if isinstance(device_map, Plan):
            check_plan_fingerprint(device_map.fingerprint, described.skeleton.fingerprint, str(root))
        dmap, the_plan = resolve_device_map(
            described.skeleton,
            device_map,
            max_memory=max_memory,
            dtype=run,
            quantization=quantization,
            workload=workload,
            offload_folder=offload_folder,
            cpu_quantization=cpu_quantization,
        )
        if quantization and the_plan is not None and any(not k.endswith(".experts") for k in the_plan.cpu_compute):
            raise PlanError(
                f"this plan computes {len(the_plan.cpu_compute)} module(s) on the CPU beside the GPUs, which the "
                f"bitsandbytes path (quantization={quantization!r}) cannot run; load without quantization, or plan "
                "for more GPU memory"
            )
        if quantization:
            reporter.set_phase("loading")
            model = load_quantized(root, dmap, getattr(torch, run), quantization, progress=None, t0=t0)
            model.loadmaster_plan = the_plan
            reporter.close()
            return LoadResult(model, dict(dmap), the_plan, model.load_stats, described.skeleton)
        if described.dtype != run:
            log.info("building %s again in %s (it was described in %s)", root, run, described.dtype)
            described = describe_checkpoint(root, run, headers=index.headers)
        placed = place(
            described,
            index,
            dmap,
            getattr(torch, run),
            reporter,
            model_path=root,
            offload_folder=Path(offload_folder) if offload_folder is not None else None,
            cpu_compute=the_plan.cpu_compute if the_plan is not None else (),
            lock_resident=cpu_residency == "lock",
        )
        reporter.set_phase("dispatching")
        executed = apply_execution(
            placed,
            cpu_kernels,
            cpu_quantization=cpu_quantization,
            cpu_quantized_dir=Path(cpu_quantized_dir) if cpu_quantized_dir is not None else None,
            checkpoint_files=[(f.path, f.size, f.mtime_ns) for f in index.files],
        )
        model = placed.model
        stats = placed.stats
        stats.native_linears = executed.native_linears
        stats.native_attention = executed.native_attention
        stats.cpu_quantization = executed.cpu_quantization
        if cpu_residency == "lock":
            stats.residency = lock_resident(model, dict(dmap))
        stats.seconds = time.perf_counter() - t0
        stats.peak_rss_bytes = peak_rss_bytes()
        model.hf_device_map = dict(dmap)
        model.loadmaster_plan = the_plan
        model.load_stats = stats
        reporter.close()
        log.info("loaded %s in %.2fs: %s", root, stats.seconds, stats.bytes_per_device)
        return LoadResult(model, dict(dmap), the_plan, stats, described.skeleton)
    except BaseException:
        reporter.fail()
        raise


def _local_checkpoint(model: str | os.PathLike, device_map: DeviceMapArg) -> tuple[Path, HubRef | None]:
    """The folder to load: ``model`` itself, or a Hub id ``org/name[@rev]`` fetched into the Hub cache (with the
    repository and commit it holds). A Plan made for a Hub commit must be loaded from that commit."""
    from loaders.checkpoint.hub_download import resolve_model_path

    path, commit = resolve_model_path(model)
    planned = device_map.revision if isinstance(device_map, Plan) else None
    if planned and commit and planned != commit:
        raise CheckpointError(
            f"The plan was made for commit {planned} of {device_map.model}, but {model} is commit "
            f"{commit}; plan again for this revision, or load {device_map.model}@{planned}."
        )
    return path, cached_snapshot_of(path) if commit else None


def load_model(
    path: str | os.PathLike,
    device_map: DeviceMapArg = "auto",
    max_memory=None,
    dtype=None,
    quantization: str | None = None,
    offload_folder: str | os.PathLike | None = None,
    *,
    progress: Callable[[LoadProgress], None] | None = None,
    show_progress: bool = True,
    cpu_kernels: str = "auto",
    cpu_quantization: str | None = None,
    cpu_quantized_dir: str | os.PathLike | None = None,
    cpu_residency: str = "lock",
    **workload,
) -> torch.nn.Module:
    """Load a sharded safetensors checkpoint onto the devices a device map (or Plan) names.

    ``path`` is a checkpoint folder or a Hub id ``org/name[@revision]`` (fetched into the Hub cache first).

    Returns the transformers model (eval mode) with ``hf_device_map``, ``loadmaster_plan`` and ``load_stats`` set.
    Raises :class:`CheckpointError` for a checkpoint that does not match its config, before any weight is
    allocated, and :class:`PlanError` for a Plan made for another checkpoint. ``cpu_kernels``: ``"auto"`` runs
    small bf16/fp32 linear products on the CPU through the native kernels where they build here
    (:mod:`loaders.native.kernel_build`), ``"native"`` insists on them, ``"torch"`` never uses them.
    ``cpu_quantization``: ``"int8"`` or ``"int4"`` quantizes the linear layers that compute on the CPU (resident or
    streamed from disk) at load, weight-only (:mod:`loaders.native.quantization`); with ``cpu_quantized_dir`` the quantized
    weights are saved there as safetensors and memory-mapped by the next load. GPU layers use ``quantization``.
    ``cpu_residency``: ``"lock"`` (the default) locks the pages of the weights placed on the CPU, so memory pressure
    cannot evict them (:mod:`loaders.checkpoint.residency`); ``"map"`` leaves them evictable maps.
    """
    return load_checkpoint(
        path,
        device_map,
        max_memory,
        dtype,
        quantization,
        offload_folder,
        progress=progress,
        show_progress=show_progress,
        cpu_kernels=cpu_kernels,
        cpu_quantization=cpu_quantization,
        cpu_quantized_dir=cpu_quantized_dir,
        cpu_residency=cpu_residency,
        **workload,
    ).model


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved next to the weights (``AutoTokenizer``, local files only), or a CheckpointError."""
    from transformers import AutoTokenizer

    root = Path(path)
    root = root.parent if root.is_file() else root
    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"No usable tokenizer in {root} ({exc}). Save one with tokenizer.save_pretrained into the model directory."
        ) from exc


def load_model_and_tokenizer(
    path: str | os.PathLike,
    device_map: DeviceMapArg = "auto",
    max_memory=None,
    dtype=None,
    quantization: str | None = None,
    offload_folder: str | os.PathLike | None = None,
    *,
    progress: Callable[[LoadProgress], None] | None = None,
    show_progress: bool = True,
    cpu_kernels: str = "auto",
    cpu_quantization: str | None = None,
    cpu_quantized_dir: str | os.PathLike | None = None,
    **workload,
):
    """:func:`load_model` plus the tokenizer saved next to the weights (``AutoTokenizer``, local files only).

    The tokenizer is read first, so a directory without one fails before any weight is loaded.
    """
    path, _ = _local_checkpoint(path, device_map)
    tokenizer = load_tokenizer(path)
    model = load_model(
        path,
        device_map,
        max_memory,
        dtype,
        quantization,
        offload_folder,
        progress=progress,
        show_progress=show_progress,
        cpu_kernels=cpu_kernels,
        cpu_quantization=cpu_quantization,
        cpu_quantized_dir=cpu_quantized_dir,
        **workload,
    )
    return model, tokenizer
