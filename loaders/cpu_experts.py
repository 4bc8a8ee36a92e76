"""Routed experts that compute on the CPU while the rest of their layer computes on a GPU.

A plan may put ``model.layers.N.mlp.experts`` on ``"cpu"`` under a layer on a GPU (:mod:`planner.sub_layer`): the
experts hold most of a MoE model's bytes, and a decode step uses only the few its tokens are routed to. Streaming
them to the GPU would copy all of them on every step; instead the hidden states, the router's choice and weights go
to the host, transformers' own experts module runs there (it computes only the experts that were hit), and the
result goes back to the device the layer computes on. Nothing is streamed and no weight leaves host RAM.

Such an entry is told apart from an ordinary CPU-offloaded block by what it names: a module path ending in
``.experts`` (the routed experts of every transformers 5 MoE family) that holds tensors of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from loaders.streaming import install_gpu_execution, move_to
from planner.types import DeviceId

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


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


def _to_host(module, args, kwargs):
    first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
    module._loadmaster_return_device = first.device if first is not None else _CPU
    return move_to(args, _CPU), move_to(kwargs, _CPU)


def _back(module, args, output):
    return move_to(output, getattr(module, "_loadmaster_return_device", _CPU))


def install_cpu_experts(model: torch.nn.Module, keys: list[str]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that run each experts module of ``keys`` on the CPU: inputs to the host, outputs back to the device
    its caller computes on."""
    handles = []
    for key in keys:
        module = model.get_submodule(key)
        handles.append(module.register_forward_pre_hook(_to_host, with_kwargs=True))
        handles.append(module.register_forward_hook(_back))
    if keys:
        log.info("%d routed-experts module(s) compute on the CPU", len(keys))
    return handles


def install_gpu_execution_with_cpu_experts(
    model: torch.nn.Module,
    device_map: Mapping[str, DeviceId],
    placement: Mapping[str, DeviceId],
    exec_device: torch.device,
    **kwargs,
):
    """:func:`loaders.streaming.install_gpu_execution` for a map whose routed experts may sit on the CPU: those
    compute there (:func:`install_cpu_experts`) and are left out of the map the GPU wiring sees, so they are neither
    aligned to the GPU nor streamed (their layer's entry, on a GPU, covers them there). ``kwargs``: backend and
    gpu_device stand-ins, as install_gpu_execution takes them. Returns its streamer."""
    experts = cpu_expert_entries(model, device_map)
    install_cpu_experts(model, experts)
    rest = {k: v for k, v in device_map.items() if k not in experts}
    return install_gpu_execution(model, rest, placement, exec_device, **kwargs)


__all__ = ["cpu_expert_entries", "install_cpu_experts", "install_gpu_execution_with_cpu_experts"]
