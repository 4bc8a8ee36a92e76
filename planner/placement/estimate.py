"""``estimate``: how big a model is in each format, and the least memory that serves a workload with it.

The minimum is exact for the planner's own accounting: it is the load of a plan that puts everything on one
device, so a device of that size (or ``max_memory`` set to it) plans without offload.
"""

from __future__ import annotations

from typing import Any

from planner.hardware.device_inventory import DEFAULT_GPU_RESERVE
from planner.hardware.units import parse_size
from planner.placement.inputs import make_workload, resolve_skeleton
from planner.placement.solve import make_problem
from planner.placement.strategies import compute_loads
from planner.types import Device, Hardware

FORMATS: tuple[tuple[str, str, str | None], ...] = (
    ("fp32", "float32", None),
    ("bf16/fp16", "bfloat16", None),
    ("int8", "float16", "int8"),
    ("nf4/fp4", "float16", "nf4"),
)
_HUGE = 1 << 62


def estimate(
    model: Any, batch_size: int = 1, context: int | None = None, gpu_reserve: int | str | None = None
) -> list[dict[str, Any]]:
    skeleton = resolve_skeleton(model)
    reserve = DEFAULT_GPU_RESERVE if gpu_reserve is None else parse_size(gpu_reserve)
    one_gpu = Hardware(devices=(Device(0, _HUGE, 1e12, 1e12),), gpu_reserve=reserve)
    cpu_only = Hardware(devices=(Device("cpu", _HUGE, 2e10, 2e10),), gpu_reserve=reserve)
    rows = []
    for label, dtype, quant in FORMATS:
        workload = make_workload(skeleton, dtype, quant, batch_size, context)
        row: dict[str, Any] = {
            "model": skeleton.name,
            "format": label,
            "dtype": dtype,
            "quantization": quant,
            "batch_size": workload.batch_size,
            "context": workload.context,
        }
        for key, hw in (("min_single_gpu", one_gpu), ("min_cpu", cpu_only)):
            problem = make_problem(skeleton, hw, workload)
            dev = hw.devices[0].id
            loads = compute_loads(problem, [dev] * len(problem.items))
            row[key] = loads.total(dev)
            row["weights"] = loads.weights.get(dev, 0)
            row["kv_cache"] = loads.kv.get(dev, 0)
            row["activations"] = loads.activations.get(dev, 0)
            row["largest_block"] = max((it.weight for it in problem.items), default=0)
        rows.append(row)
    return rows
