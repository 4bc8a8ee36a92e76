"""Which quantizer a ``quantization=`` request means, given where the layers compute.

``quantization`` names bitsandbytes, which is what GPU layers want. On a machine (or a map) without a GPU every
layer computes on the CPU, where bitsandbytes int8 decodes at 0.42x our bf16 and the native int8 kernels
(``cpu_quantization="int8"``, :mod:`loaders.native.quantization`) at 1.7x. So ``quantization="int8"`` with no GPU
among the devices is taken as the native int8 kernels, in the planner (which sizes the native layout) and in the
loader alike. ``--cpu-quantization`` stays the explicit form. nf4 and fp4 stay bitsandbytes: their values are not
the native int4 grid, so the native kernels could not give the same numbers. So does an explicit float16: the
native kernels compute in float32 or bfloat16, and bitsandbytes honours the dtype asked.

Not a torch import here: the planner's core reads this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from planner.placement.sizing import normalize_cpu_quantization, normalize_dtype, normalize_quantization

log = logging.getLogger(__name__)

#: bitsandbytes schemes a CPU-only run takes on the native kernels instead: bitsandbytes name -> native scheme.
NATIVE_ON_CPU = {"int8": "int8"}


@dataclass(frozen=True)
class QuantizationChoice:
    """The two quantizers of a run: bitsandbytes for GPU layers, the native kernels for CPU and disk layers."""

    quantization: str | None
    cpu_quantization: str | None


def choose_quantization(
    quantization: str | None, cpu_quantization: str | None, any_gpu: bool, dtype: str | None = None
) -> QuantizationChoice:
    """``quantization`` as the native CPU scheme when no GPU computes, a native kernel gives the same scheme
    (``int8``) and ``dtype`` is not float16; otherwise both as given (both at once stays an error for
    :func:`~planner.placement.inputs.make_workload` to name)."""
    quant = normalize_quantization(quantization)
    cpu_quant = normalize_cpu_quantization(cpu_quantization)
    native = NATIVE_ON_CPU.get(quant) if quant else None
    half = dtype is not None and normalize_dtype(dtype, "float32") == "float16"
    if any_gpu or native is None or half or cpu_quant not in (None, native):
        return QuantizationChoice(quant, cpu_quant)
    log.info(
        "quantization=%r with no GPU: the native %s CPU kernels (cpu_quantization=%r), not bitsandbytes",
        quant,
        native,
        native,
    )
    return QuantizationChoice(None, native)
