"""``load_model``: a checkpoint directory + a device map (or Plan) -> a ready transformers model.

The steps, each in its own module:

1. ``safetensors_index``: find and validate every shard header (nothing is allocated before this passes);
2. ``model_builder``: build the model on the meta device;
3. ``device_map``: resolve the map (or ask the planner for one) to a device per tensor;
4. ``checkpoint_layout``: match module tensors to checkpoint keys (fused MoE experts included), or raise;
5. ``materialize``: put every tensor on its device — read straight into its final memory, or memory-map the
   shard for ``"disk"``, or convert once into the ``offload_folder``;
6. buffers, ties, then ``dispatch``: hooks only where execution crosses devices or streams offloaded weights.
"""
from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch
from transformers import PreTrainedModel

from loaders.checkpoint_layout import resolve_sources
from loaders.device_map import assign_devices, execution_device, normalize_map
from loaders.errors import CheckpointError
from loaders.cpu_quant import check_cpu_quantization, quantize_cpu_linears
from loaders.fast_linear import CPU_KERNEL_CHOICES, use_native_linears
from loaders.materialize import Materializer
from loaders.model_builder import (
    build_meta_model,
    init_non_persistent_buffers,
    non_persistent_buffers,
    read_config,
    set_tensor,
    tie_weights,
)
from loaders.progress import LoadProgress, ProgressReporter, peak_rss_bytes, reset_peak_rss
from loaders.safetensors_index import CheckpointIndex
from planner.errors import PlanError
from planner.types import Plan

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
DeviceMapArg = Union[str, Mapping[str, object], Plan, None]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(dtype, config, index: CheckpointIndex) -> torch.dtype:
    """``None``/``"auto"``: the config's dtype, else the checkpoint's first float dtype (transformers' rule)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        cfg = getattr(config, "dtype", None)
        if isinstance(cfg, torch.dtype):
            return cfg
        if isinstance(cfg, str) and cfg in _DTYPES:
            return _DTYPES[cfg]
        return index.first_float_dtype() or torch.float32
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise PlanError(f"dtype {dtype!r} is not supported: use float32, float16 or bfloat16.")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device_map(path, device_map: DeviceMapArg, *, max_memory, dtype, quantization, workload,
                       offload_folder=None) -> tuple[dict, Optional[Plan]]:
    """The device map to obey. A Plan is taken as is; a strategy string asks the planner; a dict is normalised."""
    if isinstance(device_map, Plan):
        return normalize_map(device_map.device_map), device_map
    if device_map is None:
        return {"": "cpu"}, None
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            if device_map in ("cpu", "disk") or device_map.startswith("cuda") or device_map.isdigit():
                return normalize_map({"": device_map}), None
            raise PlanError(f"Unknown device_map strategy {device_map!r}: use one of {', '.join(STRATEGIES)}, "
                            "a dict of module -> device, or a Plan.")
        try:
            from planner.api import plan as make_plan
        except ImportError:  # the planner's API is not available: keep everything resident on the CPU
            log.warning("planner.plan is unavailable; loading everything on the CPU")
            return {"": "cpu"}, None
        p = make_plan(str(path), max_memory=max_memory, strategy=device_map, dtype=_dtype_name(dtype),
                      quantization=quantization, offload_folder=offload_folder, **workload)
        return normalize_map(p.device_map), p
    if isinstance(device_map, Mapping):
        return normalize_map(device_map), None
    raise PlanError(f"device_map must be a strategy name, a dict or a Plan, not {type(device_map).__name__}.")


def _keep_fp32_patterns(model: PreTrainedModel, dtype: torch.dtype) -> list[str]:
    pats = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        pats += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return pats


def load_model(
    path: Union[str, os.PathLike],
    device_map: DeviceMapArg = "auto",
    max_memory=None,
    dtype=None,
    quantization: Optional[str] = None,
    offload_folder: Union[str, os.PathLike, None] = None,
    *,
    progress: Optional[Callable[[LoadProgress], None]] = None,
    show_progress: bool = True,
    cpu_kernels: str = "auto",
    cpu_quantization: Optional[str] = None,
    cpu_quantized_dir: Union[str, os.PathLike, None] = None,
    **workload,
) -> torch.nn.Module:
    """Load a sharded safetensors checkpoint onto the devices a device map (or Plan) names.

    Returns the transformers model (eval mode) with ``hf_device_map`` and ``load_stats`` set. Raises
    :class:`CheckpointError` for a checkpoint that does not match its config, before any weight is allocated.
    ``cpu_kernels``: ``"auto"`` runs small bf16/fp32 linear products on the CPU through the native kernels where
    they build here (:mod:`loaders.cpu_kernels`), ``"native"`` insists on them, ``"torch"`` never uses them.
    ``cpu_quantization``: ``"int8"`` or ``"int4"`` quantizes the linear layers that compute on the CPU (resident or
    streamed from disk) at load, weight-only (:mod:`loaders.cpu_quant`); with ``cpu_quantized_dir`` the quantized
    weights are saved there as safetensors and memory-mapped by the next load. GPU layers use ``quantization``.
    """
    if cpu_kernels not in CPU_KERNEL_CHOICES:
        raise PlanError(f"cpu_kernels={cpu_kernels!r} is not one of {', '.join(CPU_KERNEL_CHOICES)}.")
    check_cpu_quantization(cpu_quantization, quantization, cpu_quantized_dir)
    t0 = time.perf_counter()
    reset_peak_rss()
    path = Path(path)
    if isinstance(device_map, Plan):
        dtype = dtype if dtype is not None else device_map.workload.dtype
        quantization = quantization if quantization is not None else device_map.workload.quantization
    index = CheckpointIndex.open(path)
    config = read_config(path)
    run_dtype = resolve_dtype(dtype, config, index)
    dmap, plan = resolve_device_map(path, device_map, max_memory=max_memory, dtype=run_dtype,
                                    quantization=quantization, workload=workload,
                                    offload_folder=offload_folder)
    if quantization:
        from loaders.quantized import load_quantized

        return load_quantized(path, dmap, run_dtype, quantization, progress=progress, t0=t0)

    reporter = ProgressReporter(index.total_bytes(), progress, show_bar=show_progress)
    try:
        reporter.set_phase("building")
        model = build_meta_model(config, run_dtype)
        tied_targets = set(getattr(model, "all_tied_weights_keys", {}) or {})
        np_bufs = non_persistent_buffers(model)
        wanted = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)
                  if n not in tied_targets}
        wanted.update({n: tuple(b.shape) for n, b in model.named_buffers(remove_duplicate=False)
                       if n not in np_bufs})
        ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
        ignore_unexpected += [r"rotary_emb\.inv_freq$"] + [f"^{re.escape(t)}$" for t in tied_targets]
        sources = resolve_sources(wanted, index, base_prefix=getattr(model, "base_model_prefix", ""),
                                  ignore_unexpected=ignore_unexpected,
                                  ignore_missing=getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
        all_names = list(wanted) + list(np_bufs) + sorted(tied_targets)
        placement = assign_devices(all_names, dmap, (n for n, _ in model.named_modules()))
        _check_tied_devices(model, placement)
        has_gpu = any(isinstance(d, int) for d in placement.values())
        if has_gpu and not torch.cuda.is_available():
            raise PlanError("The device map places modules on a GPU but torch sees no CUDA device here. "
                            "Plan for this machine (device_map='auto') or use 'cpu'/'disk'.")
        exec_dev = execution_device(dmap)

        reporter.set_phase("loading")
        mat = Materializer(index, run_dtype, _keep_fp32_patterns(model, run_dtype), reporter,
                           offload_folder=offload_folder, model_path=path, has_gpu=has_gpu)
        tensors = mat.materialize(sources, {n: placement[n] for n in sources})
        for name, t in tensors.items():
            set_tensor(model, name, t)
        buf_devices = {n: (torch.device("cuda", placement[n]) if isinstance(placement[n], int) else exec_dev)
                       for n in np_bufs}
        init_non_persistent_buffers(model, buf_devices)
        tie_weights(model)
        _check_materialized(model)

        reporter.set_phase("dispatching")
        from loaders.dispatch import dispatch

        dispatch(model, dmap, placement, mat, exec_dev)
        # With GPUs every block computes on a GPU (offloaded ones are streamed there): no CPU products to speed up.
        cpu_quant_stats = None
        if cpu_quantization:
            if exec_dev.type != "cpu":
                raise PlanError(f"cpu_quantization={cpu_quantization!r} quantizes layers that compute on the CPU, "
                                "but this device map computes on a GPU. Use quantization='int8' or 'nf4' "
                                "(bitsandbytes) for GPU layers.")
            cpu_quant_stats = quantize_cpu_linears(
                model, cpu_quantization, checkpoint_files=[(f.path, f.size, f.mtime_ns) for f in index.files],
                save_dir=Path(cpu_quantized_dir) if cpu_quantized_dir is not None else None)
        native = use_native_linears(model, cpu_kernels) if exec_dev.type == "cpu" else 0
        model.hf_device_map = dict(dmap)
        model.loadmaster_plan = plan
        stats = mat.stats
        stats.native_linears = native
        stats.cpu_quantization = cpu_quant_stats
        stats.seconds = time.perf_counter() - t0
        stats.peak_rss_bytes = peak_rss_bytes()
        model.load_stats = stats
        reporter.close()
        log.info("loaded %s in %.2fs: %s", path, stats.seconds, stats.bytes_per_device)
        return model
    except BaseException:
        reporter.fail()
        raise


def _check_tied_devices(model: PreTrainedModel, placement: Mapping[str, object]) -> None:
    for target, source in (getattr(model, "all_tied_weights_keys", {}) or {}).items():
        dt, ds = placement.get(target), placement.get(source)
        gpu_split = (isinstance(dt, int) or isinstance(ds, int)) and dt != ds
        if gpu_split:
            raise PlanError(f"{target} is tied to {source}, but the device map puts them on {dt!r} and {ds!r}. "
                            "Tied weights share one tensor: place both on the same device.")


def _check_materialized(model: torch.nn.Module) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"Tensors left without data after loading: {left[:10]}. This is a loader bug; "
                              "please report it with the model's config.json.")


def load_model_and_tokenizer(path: Union[str, os.PathLike], device_map: DeviceMapArg = "auto", max_memory=None,
                             dtype=None, quantization: Optional[str] = None,
                             offload_folder: Union[str, os.PathLike, None] = None, *,
                             progress: Optional[Callable[[LoadProgress], None]] = None, show_progress: bool = True,
                             cpu_kernels: str = "auto", cpu_quantization: Optional[str] = None,
                             cpu_quantized_dir: Union[str, os.PathLike, None] = None, **workload):
    """:func:`load_model` plus the tokenizer saved next to the weights (``AutoTokenizer``, local files only).

    The tokenizer is read first, so a directory without one fails before any weight is loaded.
    """
    from transformers import AutoTokenizer

    root = Path(path)
    root = root.parent if root.is_file() else root
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"No usable tokenizer in {root} ({exc}). Save one with tokenizer.save_pretrained "
                              "into the model directory.") from exc
    model = load_model(path, device_map, max_memory, dtype, quantization, offload_folder, progress=progress,
                       show_progress=show_progress, cpu_kernels=cpu_kernels, cpu_quantization=cpu_quantization,
                       cpu_quantized_dir=cpu_quantized_dir, **workload)
    return model, tokenizer
