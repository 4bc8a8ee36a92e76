"""Turning a device map (hf_device_map format) into a device for every tensor of the model.

A device map names module prefixes (``""`` is the root) or single tensors; each tensor goes where its longest
matching prefix says. Devices are an int GPU index, ``"cpu"`` or ``"disk"``; ``"cuda:1"`` and ``"1"`` are accepted
and normalised.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Mapping

import torch

from planner.devices import parse_device
from planner.errors import PlanError
from planner.types import DeviceId


def normalize_map(device_map: Mapping[str, object]) -> dict[str, DeviceId]:
    return {str(k): parse_device(v) for k, v in device_map.items()}


def _covers(prefix: str, name: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def assign_devices(names: Iterable[str], device_map: Mapping[str, DeviceId], module_names: Iterable[str] = ()
                   ) -> dict[str, DeviceId]:
    """Device of every tensor name, by longest matching prefix. Unknown or missing entries raise PlanError.

    ``module_names`` (all module paths of the model) lets a map name a module that owns no tensors of its own.
    """
    names = list(names)
    known = set(names) | set(module_names)
    for n in names:  # every ancestor prefix of a tensor is a valid map key
        parts = n.split(".")
        for i in range(1, len(parts)):
            known.add(".".join(parts[:i]))
    unknown = [k for k in device_map if k != "" and k not in known]
    if unknown:
        hints = []
        for k in unknown[:5]:
            near = difflib.get_close_matches(k, sorted(known), n=3)
            hints.append(f"{k!r}" + (f" (did you mean {', '.join(near)}?)" if near else ""))
        raise PlanError(f"The device map names modules this model does not have: {'; '.join(hints)}. "
                        "Use module names as printed by model.named_modules().")
    by_len = sorted(device_map, key=len, reverse=True)
    out: dict[str, DeviceId] = {}
    uncovered = []
    for n in names:
        for p in by_len:
            if _covers(p, n):
                out[n] = device_map[p]
                break
        else:
            uncovered.append(n)
    if uncovered:
        shown = ", ".join(uncovered[:10]) + (f", ... ({len(uncovered) - 10} more)" if len(uncovered) > 10 else "")
        raise PlanError(f"The device map leaves {len(uncovered)} tensors without a device: {shown}. "
                        "Add entries for them (or a '' entry for everything not named).")
    return out


def entry_of(name: str, device_map: Mapping[str, DeviceId]) -> str:
    """The device-map key that places tensor ``name`` (its longest covering prefix)."""
    best = None
    for p in device_map:
        if _covers(p, name) and (best is None or len(p) > len(best)):
            best = p
    if best is None:
        raise KeyError(name)
    return best


def execution_device(device_map: Mapping[str, DeviceId]) -> torch.device:
    """Where offloaded blocks compute: the lowest GPU index in the map, or the CPU when the map names no GPU."""
    gpus = sorted(d for d in device_map.values() if isinstance(d, int))
    return torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")
