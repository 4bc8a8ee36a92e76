"""The one load: a checkpoint + a device map (or Plan, or plan inputs) -> a ready transformers model.

:func:`load_checkpoint` is the only place the steps are put in order; every caller goes through it (``load_model``,
the served model's background load, each pipeline rank's stage through :func:`load_stage`). The steps, each in
its own room:

1. open: ``loaders.checkpoint.index`` reads and validates every shard header (nothing is allocated before this
   passes); a plan made for another checkpoint is refused here;
2. describe: the planner's ``describe_checkpoint`` builds the model's Skeleton and its meta model once (or takes
   the one a caller already described);
3. plan: a Plan is obeyed; a strategy name or ``PlanInputs`` is planned from that same Skeleton; a dict is taken
   as is;
4. place: ``loaders.checkpoint.placement`` puts every tensor on its device (validated map, checkpoint key mapping,
   materialisation, offload folder);
5. execute: ``loaders.run.execution`` (hooks, streaming, readahead) and ``loaders.native`` (CPU quantization,
   kernels) make the placed model run; the CPU's pages are locked.

A pipeline stage is the same load restricted (:class:`~loaders.pipeline_stage.StageRestriction`): step 1 indexes only
the stage's tensors, step 2 describes the stage's sub-model, step 3 is the stage's plan, and a last step wraps the
stage's slots.
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
from loaders.pipeline_stage import StageModel, StageRestriction
from loaders.run.execution import apply_execution
from planner.api import plan as make_plan
from planner.api import plan_inputs
from planner.cluster import ClusterPlan
from planner.errors import PlanError
from planner.hardware.devices import is_gpu, parse_device
from planner.model.fingerprint import check_plan_fingerprint, checkpoint_fingerprint
from planner.model.model_ref import HubRef, cached_snapshot_of
from planner.model.skeleton import CheckpointModel, describe_checkpoint
from planner.placement.inputs import PlanInputs, make_workload
from planner.placement.quantization_choice import choose_quantization
from planner.placement.sizing import normalize_dtype
from planner.placement.solve import STRATEGY_NAMES
from planner.types import DeviceId, Plan, Skeleton

log = logging.getLogger(__name__)

DeviceMapArg = str | Mapping[str, object] | Plan | PlanInputs | None
Source = str | os.PathLike | CheckpointModel


@dataclass
class LoadResult:
    """What a load produced, typed: the ready model, the map it obeys, the plan (if any) and what it cost.

    ``stats.bytes_per_device`` is where the weights went by *placement* ("cpu", "disk", "cuda:N"): disk-offloaded
    tensors are memory maps that torch reports as CPU tensors, so this, not the tensors' devices, is the truth; for
    the same reason ``resident_bytes`` (weights and buffers held in RAM or on a GPU, tied ones once) leaves out the
    tensors placed on disk. ``stage`` is set when the load was restricted to a pipeline stage.
    """

    model: torch.nn.Module
    device_map: dict[str, DeviceId]
    plan: Plan | None
    stats: LoadStats
    skeleton: Skeleton
    resident_bytes: int = 0
    stage: StageModel | None = None


@dataclass(frozen=True)
class LoadOptions:
    """How this host holds and runs the weights it is given, beside where they go (the device map): checked when
    made, so a misspelt choice fails before any file is read."""

    offload_folder: Path | None = None
    cpu_kernels: str = "auto"
    cpu_quantized_dir: Path | None = None
    cpu_residency: str = "lock"

    def __post_init__(self) -> None:
        if self.cpu_kernels not in CPU_KERNEL_CHOICES:
            raise PlanError(f"cpu_kernels={self.cpu_kernels!r} is not one of {', '.join(CPU_KERNEL_CHOICES)}.")
        if self.cpu_residency not in CPU_RESIDENCY_CHOICES:
            raise PlanError(f"cpu_residency={self.cpu_residency!r} is not one of {', '.join(CPU_RESIDENCY_CHOICES)}.")


@dataclass(frozen=True)
class AskedWorkload:
    """What the weights are loaded as: the dtype name asked (None: the checkpoint's), bitsandbytes quantization for
    GPU layers and the native CPU quantization. A Plan's own, when one is given: its budgets were sized for them."""

    dtype: str | None
    quantization: str | None
    cpu_quantization: str | None


@dataclass(frozen=True)
class OpenedCheckpoint:
    """The checkpoint a load reads: its folder, its validated index, the Hub repository and commit it holds (if
    any), and the description a caller already made of it (if any)."""

    root: Path
    index: CheckpointIndex
    hub: HubRef | None
    described: CheckpointModel | None


@dataclass(frozen=True)
class ResolvedMap:
    """Where each block goes: the device map to obey, the plan it came from (if any), and the modules that plan
    computes on the CPU beside the GPUs."""

    device_map: dict[str, DeviceId]
    plan: Plan | None
    cpu_compute: tuple[str, ...] = ()


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


def _asked_workload(
    device_map: DeviceMapArg, dtype, quantization, cpu_quantization, max_memory, workload: Mapping
) -> AskedWorkload:
    """The workload to load: a Plan's (a dtype or quantization asked beside it wins, a different CPU quantization
    is refused), the inputs' a plan will be made from, or what the caller asked. ``quantization="int8"`` where no
    GPU computes is the native int8 CPU kernels (:mod:`planner.placement.quantization_choice`)."""
    given = _dtype_name(dtype)
    if isinstance(device_map, Plan):
        asked = AskedWorkload(
            given or device_map.workload.dtype,
            quantization if quantization is not None else device_map.workload.quantization,
            _planned_cpu_quantization(device_map, cpu_quantization),
        )
    elif isinstance(device_map, PlanInputs):
        asked = AskedWorkload(
            given or _dtype_name(device_map.dtype),
            quantization if quantization is not None else device_map.quantization,
            cpu_quantization if cpu_quantization is not None else device_map.cpu_quantization,
        )
    else:
        asked = AskedWorkload(given, quantization, cpu_quantization)
    if asked.quantization is None:
        return asked
    choice = choose_quantization(
        asked.quantization, asked.cpu_quantization, _any_gpu(device_map, max_memory, workload), asked.dtype
    )
    return replace(asked, quantization=choice.quantization, cpu_quantization=choice.cpu_quantization)


def _any_gpu(device_map: DeviceMapArg, max_memory, workload: Mapping) -> bool:
    """Whether a GPU computes any of the model under ``device_map``: a Plan's or a map's devices, or, for a
    strategy still to be planned, the devices ``max_memory`` (or detection) gives the planner."""
    if isinstance(device_map, Plan):
        return any(is_gpu(parse_device(d)) for d in device_map.device_map.values())
    if isinstance(device_map, PlanInputs):
        return any(is_gpu(d.id) for d in device_map.hardware().devices)
    if isinstance(device_map, Mapping):
        return any(is_gpu(parse_device(d)) for d in device_map.values())
    if device_map is None or device_map in ("cpu", "disk"):
        return False
    if isinstance(device_map, str) and device_map in STRATEGY_NAMES:
        inputs = PlanInputs(max_memory=max_memory, gpus=workload.get("gpus"), gpu_reserve=workload.get("gpu_reserve"))
        return any(is_gpu(d.id) for d in inputs.hardware().devices)
    return isinstance(device_map, int) or (
        isinstance(device_map, str) and (device_map.startswith("cuda") or device_map.isdigit())
    )


def _run_dtype(skeleton: Skeleton, device_map: DeviceMapArg, asked: AskedWorkload) -> str:
    """The dtype the weights are loaded in: the planner's default when none is given (for inputs still to be
    planned, with their quantization, as the planner will choose)."""
    if isinstance(device_map, PlanInputs):
        return make_workload(skeleton, asked.dtype, asked.quantization, cpu_quantization=asked.cpu_quantization).dtype
    return make_workload(skeleton, asked.dtype, cpu_quantization=asked.cpu_quantization).dtype


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
) -> ResolvedMap:
    """The device map to obey. A Plan is taken as is; a strategy name or :class:`PlanInputs` is planned from
    ``skeleton``; a dict (or a single device) is normalised, and validated against the model at placement."""
    if isinstance(device_map, Plan):
        return ResolvedMap(normalize_map(device_map.device_map), device_map, tuple(device_map.cpu_compute))
    if device_map is None:
        return ResolvedMap({"": "cpu"}, None)
    if isinstance(device_map, PlanInputs):
        inputs = replace(device_map, dtype=dtype, quantization=quantization, cpu_quantization=cpu_quantization)
        return resolve_device_map(
            skeleton,
            plan_inputs(skeleton, inputs),
            max_memory=None,
            dtype=dtype,
            quantization=quantization,
            workload={},
        )
    if isinstance(device_map, str):
        if device_map not in STRATEGY_NAMES:
            if device_map in ("cpu", "disk") or device_map.startswith("cuda") or device_map.isdigit():
                return ResolvedMap(normalize_map({"": device_map}), None)
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
        return resolve_device_map(skeleton, p, max_memory=None, dtype=dtype, quantization=quantization, workload={})
    if isinstance(device_map, Mapping):
        return ResolvedMap(normalize_map(device_map), None)
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
    stage: StageRestriction | None = None,
    **workload,
) -> LoadResult:
    """THE load: describe → plan → place → execute. See :func:`load_model` for the arguments.

    ``source`` is a checkpoint directory (or Hub id), or the :class:`~planner.model.skeleton.CheckpointModel` a
    caller already described: its meta model is filled in place rather than built again. ``device_map`` may also be
    the :class:`~planner.placement.inputs.PlanInputs` to plan with, from the Skeleton described here.

    ``stage`` restricts the load to one pipeline stage (:func:`load_stage`): only its tensors are read, its
    sub-model is described in place of the whole model, its stage plan is obeyed, and ``result.stage`` is the
    stage ready to run. The steps are the same; the restriction only narrows what each is given.
    """
    t0 = time.perf_counter()
    reset_peak_rss()
    options = LoadOptions(_path(offload_folder), cpu_kernels, _path(cpu_quantized_dir), cpu_residency)
    asked = _asked_workload(device_map, dtype, quantization, cpu_quantization, max_memory, workload)
    opened = _open(source, device_map)
    _check_fingerprint(opened, device_map, stage)
    tensors = stage.select(opened.root, opened.index.headers) if stage is not None else None
    reporter = ProgressReporter(
        (tensors.index if tensors is not None else opened.index).total_bytes(), progress, show_bar=show_progress
    )
    try:
        reporter.set_phase("building")
        view = stage.describe(opened.root, tensors, asked.dtype) if stage is not None and tensors is not None else None
        described = view.described if view is not None else _describe(opened, asked.dtype)
        run = _run_dtype(described.skeleton, device_map, asked)
        check_cpu_quantization(
            asked.cpu_quantization,
            asked.quantization,
            options.cpu_quantized_dir,
            getattr(torch, run),
            prequantized=described.skeleton.stored_format is not None,
        )
        if stage is not None:
            resolved = ResolvedMap(stage.device_map(), stage.stage.plan, stage.cpu_compute())
        else:
            if isinstance(device_map, PlanInputs) or device_map in STRATEGY_NAMES:
                reporter.set_phase("planning")
            resolved = resolve_device_map(
                described.skeleton,
                device_map,
                max_memory=max_memory,
                dtype=run,
                quantization=asked.quantization,
                workload=workload,
                offload_folder=offload_folder,
                cpu_quantization=asked.cpu_quantization,
            )
        if asked.quantization:
            return _load_bitsandbytes(opened.root, resolved, run, asked.quantization, described, stage, reporter, t0)
        if view is None and described.dtype != run:
            log.info("building %s again in %s (it was described in %s)", opened.root, run, described.dtype)
            described = describe_checkpoint(opened.root, run, headers=opened.index.headers)
        index = tensors.index if tensors is not None else opened.index
        result = _place_and_execute(described, index, resolved, run, asked, options, opened, reporter)
        result.stats.seconds = time.perf_counter() - t0
        result.stats.peak_rss_bytes = peak_rss_bytes()
        if view is not None:
            result.stage = view.finish(result.model, result.stats, result.resident_bytes)
        reporter.close()
        log.info("loaded %s in %.2fs: %s", opened.root, result.stats.seconds, result.stats.bytes_per_device)
        return result
    except BaseException:
        reporter.fail()
        raise


def _path(folder: str | os.PathLike | None) -> Path | None:
    return Path(folder) if folder is not None else None


def _open(source: Source, device_map: DeviceMapArg) -> OpenedCheckpoint:
    """Read and validate every shard header (nothing is allocated before this passes); a Hub id is fetched first."""
    if isinstance(source, CheckpointModel):
        root = Path(source.headers.directory)
        return OpenedCheckpoint(root, CheckpointIndex.from_headers(source.headers), None, source)
    root, hub = _local_checkpoint(source, device_map)
    root = root.parent if root.is_file() else root
    return OpenedCheckpoint(root, CheckpointIndex.open(root), hub, None)


def _check_fingerprint(opened: OpenedCheckpoint, device_map: DeviceMapArg, stage: StageRestriction | None) -> None:
    """Refuse a plan (or a pipeline's plan) made for another checkpoint than the one opened."""
    planned = stage.plan.fingerprint if stage is not None else getattr(device_map, "fingerprint", None)
    if isinstance(device_map, Plan) or stage is not None:
        here = (
            opened.described.skeleton.fingerprint if opened.described else checkpoint_fingerprint(opened.index.headers)
        )
        check_plan_fingerprint(planned, here, str(opened.root))


def _describe(opened: OpenedCheckpoint, dtype: str | None) -> CheckpointModel:
    """The model's Skeleton and meta model, built once from the headers already read (or the caller's). A plan
    made here from a Hub snapshot names the Hub repository and commit."""
    if opened.described is not None:
        return opened.described
    described = describe_checkpoint(opened.root, dtype, headers=opened.index.headers)
    if opened.hub is None:
        return described
    return replace(
        described, skeleton=replace(described.skeleton, name=opened.hub.repo_id, revision=opened.hub.revision)
    )


def _load_bitsandbytes(
    root: Path,
    resolved: ResolvedMap,
    dtype: str,
    quantization: str,
    described: CheckpointModel,
    stage: StageRestriction | None,
    reporter: ProgressReporter,
    t0: float,
) -> LoadResult:
    """GPU layers quantized by bitsandbytes: transformers' own quantized load of the whole model on the map."""
    if stage is not None:
        raise PlanError(
            f"a pipeline stage cannot load with quantization={quantization!r} (bitsandbytes loads a whole model); "
            "plan the cluster without --quantization, or with --cpu-quantization for CPU layers"
        )
    if resolved.plan is not None and any(not k.endswith(".experts") for k in resolved.cpu_compute):
        raise PlanError(
            f"this plan computes {len(resolved.cpu_compute)} module(s) on the CPU beside the GPUs, which the "
            f"bitsandbytes path (quantization={quantization!r}) cannot run; load without quantization, or plan "
            "for more GPU memory"
        )
    reporter.set_phase("loading")
    model = load_quantized(root, resolved.device_map, getattr(torch, dtype), quantization, progress=None, t0=t0)
    model.loadmaster_plan = resolved.plan
    reporter.close()
    return LoadResult(model, dict(resolved.device_map), resolved.plan, model.load_stats, described.skeleton)


def _place_and_execute(
    described: CheckpointModel,
    index: CheckpointIndex,
    resolved: ResolvedMap,
    dtype: str,
    asked: AskedWorkload,
    options: LoadOptions,
    opened: OpenedCheckpoint,
    reporter: ProgressReporter,
) -> LoadResult:
    """Every tensor on its device (loaders.checkpoint), then made to run there (loaders.run, loaders.native):
    hooks, streaming and readahead of disk blocks, CPU quantization, native kernels; the CPU's pages locked."""
    dmap = resolved.device_map
    placed = place(
        described,
        index,
        dmap,
        getattr(torch, dtype),
        reporter,
        model_path=opened.root,
        offload_folder=options.offload_folder,
        cpu_compute=resolved.cpu_compute,
        quantized_on_cpu=asked.cpu_quantization is not None,
    )
    model = placed.model
    on_disk = {id(t) for n, t in _named_tensors(model) if placed.tensor_devices.get(n) == "disk"}
    reporter.set_phase("dispatching")
    executed = apply_execution(
        placed,
        options.cpu_kernels,
        cpu_quantization=asked.cpu_quantization,
        cpu_quantized_dir=options.cpu_quantized_dir,
        checkpoint_files=[(f.path, f.size, f.mtime_ns) for f in opened.index.files],
        disk_cached=resolved.plan.prediction.disk_cached if resolved.plan is not None else None,
    )
    stats = placed.stats
    stats.native_linears = executed.native_linears
    stats.native_attention = executed.native_attention
    stats.cpu_quantization = executed.cpu_quantization
    if options.cpu_residency == "lock":
        stats.residency = lock_resident(model, dict(dmap))
    model.hf_device_map = dict(dmap)
    model.loadmaster_plan = resolved.plan
    model.load_stats = stats
    resident = _resident_bytes(model, on_disk)
    return LoadResult(model, dict(dmap), resolved.plan, stats, described.skeleton, resident)


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def _resident_bytes(model: torch.nn.Module, on_disk: set[int]) -> int:
    """Bytes of the tensors held in memory (RAM or GPU), each once: not those served from disk."""
    seen: set[int] = set()
    total = 0
    for _, t in _named_tensors(model):
        if t.device.type != "meta" and id(t) not in seen and id(t) not in on_disk:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def load_stage(
    checkpoint: str | os.PathLike,
    plan: ClusterPlan,
    index: int,
    *,
    progress: Callable[[LoadProgress], None] | None = None,
    offload_folder: str | os.PathLike | None = None,
    cpu_kernels: str = "auto",
    cpu_quantization: str | None = None,
    cpu_quantized_dir: str | os.PathLike | None = None,
    cpu_residency: str = "lock",
) -> StageModel:
    """Stage ``index`` of ``plan``: :func:`load_checkpoint` restricted to that stage's tensors
    (:class:`~loaders.pipeline_stage.StageRestriction`). Each of its blocks lands on the device its stage plan
    names (a GPU, the CPU, or disk, streamed as in one process), CPU layers are quantized (``cpu_quantization``,
    which must be the cluster plan's) and run on the native kernels (``cpu_kernels``) as a one-host load does.

    ``offload_folder`` and ``cpu_quantized_dir`` get a ``stage-<index>`` folder each, so ranks of one host sharing
    a folder never overwrite each other's files (a stage names its layers from 0, as its sub-model does).
    """
    restriction = StageRestriction.of(plan, index, cpu_quantization)
    result = load_checkpoint(
        checkpoint,
        restriction.stage.plan,
        offload_folder=restriction.folder(offload_folder),
        progress=progress,
        show_progress=False,
        cpu_kernels=cpu_kernels,
        cpu_quantization=plan.workload.cpu_quantization,
        cpu_quantized_dir=restriction.folder(cpu_quantized_dir),
        cpu_residency=cpu_residency,
        stage=restriction,
    )
    assert result.stage is not None, "a load restricted to a stage returns the stage"
    return result.stage


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
    weights are saved there as safetensors and memory-mapped by the next load; a GPTQ, AWQ or compressed-tensors
    checkpoint's layers repacked into the int4/int8 layouts are saved and mapped there too
    (:mod:`loaders.native.repack_cache`). GPU layers use ``quantization``.
    ``cpu_residency``: ``"lock"`` (the default) locks the pages of the weights placed on the CPU, so memory pressure
    cannot swap them out (:mod:`loaders.checkpoint.residency`); ``"map"`` leaves them unlocked (they are private
    copies either way; the name is kept for compatibility).
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
