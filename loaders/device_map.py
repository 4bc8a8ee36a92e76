"""A device map (hf_device_map format) as the loader's execution side needs it: torch devices and module order.

Validating a map against a model and placing every tensor is the planner's (:func:`planner.device_map.
assign_devices`, the one validator), and so is reading a device's spelling (:mod:`planner.devices`); this module
adds what involves torch: the execution device, and the modules a map's keys name, in the order they run.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from planner.device_map import covering_key
from planner.devices import parse_device
from planner.types import DeviceId


def normalize_map(device_map: Mapping[str, object]) -> dict[str, DeviceId]:
    return {str(k): parse_device(v) for k, v in device_map.items()}


def entry_of(name: str, device_map: Mapping[str, DeviceId]) -> str:
    """The device-map key that places tensor ``name`` (its longest covering prefix); KeyError when none does."""
    key = covering_key(name, device_map)
    if key is None:
        raise KeyError(name)
    return key


def execution_device(device_map: Mapping[str, DeviceId]) -> torch.device:
    """Where offloaded blocks compute: the lowest GPU index in the map, or the CPU when the map names no GPU."""
    gpus = sorted(d for d in device_map.values() if isinstance(d, int))
    return torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")


def ordered_entries(model: torch.nn.Module, device_map: Mapping[str, DeviceId]) -> list[str]:
    """Device-map keys in module order (the order blocks run in for decoder stacks)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    pos = {}
    for key in device_map:
        mod_key = key
        while mod_key and mod_key not in order:
            mod_key = mod_key.rpartition(".")[0]
        pos[key] = order.get(mod_key, 0)
    return sorted(device_map, key=lambda k: (pos[k], k))


def module_for_entry(model: torch.nn.Module, key: str) -> torch.nn.Module:
    """The module a device-map key names; for a single-tensor key, the module owning that tensor."""
    try:
        return model.get_submodule(key)
    except AttributeError:
        return model.get_submodule(key.rpartition(".")[0])
