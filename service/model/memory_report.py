"""Memory per device, planned (from the plan in force) and measured (from the load's typed result and CUDA's
allocator).

Measured weights are what the loader placed on each device (:class:`loaders.LoadStats`), not where torch says each
tensor lives: disk-offloaded weights are memory maps of the checkpoint, which torch reports as CPU tensors. For
GPUs, the allocator's live figure is reported too, since it also holds the KV cache and activations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from planner.hardware.devices import device_key
from planner.types import Plan

if TYPE_CHECKING:
    from loaders.checkpoint.load_progress import LoadStats


def weight_bytes_by_device(stats: LoadStats) -> dict[str, int]:
    """Bytes of weights per device label ("0", "1", "cpu", "disk"), as the load placed them."""
    return {device_key(device): n for device, n in stats.bytes_by_device_id().items()}


def planned_bytes_by_device(plan: Plan | None) -> dict[str, dict[str, int]]:
    if plan is None:
        return {}
    return {
        device_key(b.device): {
            "capacity": b.capacity,
            "weights": b.weights,
            "kv_cache": b.kv_cache,
            "activations": b.activations,
            "reserve": b.reserve,
            "draft": b.draft,
            "total": b.total,
        }
        for b in plan.budgets
    }


def memory_report(plan: Plan | None, weights: dict[str, int] | None) -> dict[str, Any]:
    """Per device: ``planned`` (the plan's budget) and ``measured`` (weights placed there, from
    :func:`weight_bytes_by_device`, and CUDA allocated/reserved)."""
    planned = planned_bytes_by_device(plan)
    measured_weights = weights or {}
    devices = sorted(set(planned) | set(measured_weights), key=lambda d: (not d.isdigit(), d))
    report: dict[str, Any] = {}
    for dev in devices:
        entry: dict[str, Any] = {"planned": planned.get(dev), "measured": {"weights": measured_weights.get(dev, 0)}}
        if dev.isdigit() and torch.cuda.is_available() and int(dev) < torch.cuda.device_count():
            entry["measured"]["allocated"] = torch.cuda.memory_allocated(int(dev))
            entry["measured"]["reserved"] = torch.cuda.memory_reserved(int(dev))
        report[dev] = entry
    return report


def memory_gauges(report: dict[str, Any]) -> dict[tuple[str, str], int]:
    """The report flattened for Prometheus: (device, kind) -> bytes."""
    out: dict[tuple[str, str], int] = {}
    for dev, entry in report.items():
        if entry.get("planned"):
            out[(dev, "planned")] = int(entry["planned"]["total"])
        measured = entry["measured"]
        out[(dev, "measured")] = int(measured.get("allocated", measured.get("weights", 0)))
    return out
