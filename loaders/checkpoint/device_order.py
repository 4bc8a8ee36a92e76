"""A device map (hf_device_map format) as the loader's execution side needs it: torch devices and module order.

Validating a map against a model and placing every tensor is the planner's (:func:`planner.placement.hf_device_map.
assign_devices`, the one validator), and so is reading a device's spelling (:mod:`planner.hardware.devices`); this module
adds what involves torch: the execution device, and the modules a map's keys name, in the order they run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from planner.errors import PlanError
from planner.hardware.devices import parse_device
from planner.placement.hf_device_map import covering_key
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


def cpu_expert_entries(model: torch.nn.Module, device_map: Mapping[str, DeviceId]) -> list[str]:
    """The device-map keys that place a routed-experts module on the CPU (computed there, never streamed)."""
    out = []
    for key, dev in device_map.items():
        if dev != "cpu" or not key.endswith(".experts"):
            continue
        try:
            module = model.get_submodule(key)
        except AttributeError:
            continue
        if any(True for _ in module.parameters()):
            out.append(key)
    return out


def cpu_compute_entries(
    model: torch.nn.Module, device_map: Mapping[str, DeviceId], cpu_compute: Collection[str] = ()
) -> list[str]:
    """Every device-map key whose module computes on the CPU while GPUs compute the rest: routed experts on
    ``cpu`` and the keys a plan lists in ``cpu_compute`` (each must be a ``cpu`` key of the map naming a module)."""
    keys = cpu_expert_entries(model, device_map)
    for key in cpu_compute:
        if device_map.get(key) != "cpu":
            raise PlanError(
                f"the plan computes {key!r} on the CPU, but its device map does not place {key!r} on 'cpu'; "
                "plan again, or pass the plan's device_map unchanged"
            )
        try:
            model.get_submodule(key)
        except AttributeError:
            raise PlanError(
                f"the plan computes {key!r} on the CPU, but this model has no module {key!r}; "
                "the plan was made for another architecture: plan again for this checkpoint"
            ) from None
        if key not in keys:
            keys.append(key)
    return keys


def is_under(name: str, keys: Collection[str]) -> bool:
    """Whether tensor or module ``name`` is one of ``keys`` or lies below one."""
    return any(name == k or k == "" or name.startswith(k + ".") for k in keys)


def host_computed(
    model: torch.nn.Module, device_map: Mapping[str, DeviceId], cpu_compute: Collection[str], names: Collection[str]
) -> set[str]:
    """Which of tensor ``names`` belong to modules that compute on the CPU beside the GPUs (never copied to one, so
    never pinned): CPU experts, a plan's ``cpu_compute`` keys, and embeddings looked up on the host."""
    keys = cpu_compute_entries(model, device_map, cpu_compute) + host_lookup_weights(model, device_map)
    return {n for n in names if is_under(n, keys)}


def host_lookup_weights(model: torch.nn.Module, device_map: Mapping[str, DeviceId]) -> list[str]:
    """The weights of input embeddings placed on ``cpu``: the streamer looks their rows up on the host
    (``loaders.run.streaming.host_lookup_modules``), so they never cross to a GPU and pinning them only locks
    memory (2 GiB for a 128k x 8k bf16 table; issue 34 defect 5). A table tied to the output head is copied to the
    GPU as the head, so it is left out."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Embedding) or mod is head or mod is model:
            continue
        if head is not None and (tied or getattr(head, "weight", None) is mod.weight):
            continue
        weight = f"{name}.weight"
        key = covering_key(weight, device_map)
        if key is not None and device_map[key] == "cpu":
            out.append(weight)
    return out
