"""Which kernel computes the layers of each tier of a plan, so that a plan says how it will run, not only where.

The loader makes the same choices (:mod:`loaders.native.linear`, :mod:`loaders.native.packed_formats`,
:mod:`loaders.checkpoint.bitsandbytes_load`) with ``cpu_kernels="auto"``: GPU layers run torch in the compute
dtype or bitsandbytes (``quantization``); pre-quantized layers are dequantized on a GPU; where no GPU computes,
CPU and disk layers run the native kernels of their format (``cpu_quantization``, or the checkpoint's own
``quantization_config``); where GPUs compute, CPU and disk layers stream to the first GPU, except the modules the
plan computes on the CPU beside them (``cpu_compute``: routed experts, layers that did not fit), which run the
float kernels.

Not a torch import here: the planner's core reads this.
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.hardware.devices import device_label, is_gpu
from planner.types import DeviceId, Skeleton, Workload

#: The native float kernels by compute dtype (decode rows; prompts run torch's GEMM); float16 has none.
FLOAT_KERNELS = {"bfloat16": "linear_bf16", "float32": "linear_f32"}
#: The native weight-only kernels by ``cpu_quantization`` scheme (decode rows and prompts).
NATIVE_KERNELS = {"int8": "linear_q8 (native int8)", "int4": "linear_q4 (native int4)"}


def gpu_kernel(skeleton: Skeleton, workload: Workload) -> str:
    """What computes a layer on a GPU."""
    if skeleton.stored_format is not None:
        return f"{skeleton.stored_format.describe}, dequantized to {workload.dtype} on the GPU (torch)"
    if workload.quantization:
        return f"bitsandbytes {workload.quantization}"
    return f"torch {workload.dtype}"


def float_kernel(dtype: str) -> str:
    """What computes an unquantized layer on the CPU in ``dtype``."""
    native = FLOAT_KERNELS.get(dtype)
    return f"{native} (decode rows; torch's GEMM for prompts)" if native else f"torch {dtype}"


def cpu_kernel(skeleton: Skeleton, workload: Workload) -> str:
    """What computes a layer on the CPU where no GPU computes."""
    if skeleton.stored_format is not None:
        return skeleton.stored_format.cpu_kernel
    if workload.cpu_quantization:
        return NATIVE_KERNELS[workload.cpu_quantization]
    if workload.quantization:
        return f"bitsandbytes {workload.quantization} (its CPU backend)"
    return float_kernel(workload.dtype)


def tier_kernels(
    skeleton: Skeleton, workload: Workload, devices: Iterable[DeviceId], cpu_compute: bool
) -> dict[str, str]:
    """Device label -> the kernel its layers run on, for each device that holds layers (``devices``, in the
    plan's order). ``cpu_compute``: the plan computes some modules on the CPU beside the GPUs."""
    used = list(dict.fromkeys(devices))
    any_gpu = any(is_gpu(d) for d in used)
    out: dict[str, str] = {}
    for d in used:
        if is_gpu(d):
            out[device_label(d)] = gpu_kernel(skeleton, workload)
        elif not any_gpu:
            where = ", read from the shard's map each step" if d == "disk" else ""
            out[device_label(d)] = cpu_kernel(skeleton, workload) + where
        else:
            text = f"streamed to the GPU: {gpu_kernel(skeleton, workload)}"
            if d == "cpu" and cpu_compute:
                text += f"; the modules computed on the CPU: {float_kernel(workload.dtype)}"
            out[device_label(d)] = text
    return out
