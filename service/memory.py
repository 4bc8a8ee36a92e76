"""Memory per device, planned (from the plan in force) and measured (from the loaded model and CUDA's allocator).

Measured weights are counted from where each parameter and buffer actually sits (``meta`` ones are offloaded to
disk); for GPUs, the allocator's live figure is reported too, since it also holds the KV cache and activations.
"""
from __future__ import annotations

from typing import Any

import torch

from planner.devices import DISK, device_key, parse_device
from planner.types import Plan


def _device_label(device: torch.device) -> str:
    """A tensor's device as a report key ("0", "cpu"); a ``meta`` tensor's weights are offloaded to disk."""
    return device_key(DISK if device.type == "meta" else parse_device(device))


def weight_bytes_by_device(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters and buffers per device label ("0", "1", "cpu", "disk")."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    tensors = list(model.parameters()) + list(model.buffers())
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        label = _device_label(t.device)
        out[label] = out.get(label, 0) + t.numel() * t.element_size()
    return out


def planned_bytes_by_device(plan: Plan | None) -> dict[str, dict[str, int]]:
    if plan is None:
        return {}
    return {
        str(b.device): {
            "capacity": b.capacity,
            "weights": b.weights,
            "kv_cache": b.kv_cache,
            "activations": b.activations,
            "reserve": b.reserve,
            "total": b.total,
        }
        for b in plan.budgets
    }


def memory_report(model: torch.nn.Module | None, plan: Plan | None, weights: dict[str, int] | None = None) -> dict[str, Any]:
    """Per device: ``planned`` (the plan's budget) and ``measured`` (weights there, and CUDA allocated/reserved)."""
    planned = planned_bytes_by_device(plan)
    measured_weights = weights if weights is not None else (weight_bytes_by_device(model) if model is not None else {})
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
