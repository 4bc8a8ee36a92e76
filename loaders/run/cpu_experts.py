"""Modules that compute on the CPU, where their weights live, while GPUs compute the rest of the model.

A plan may put ``model.layers.N.mlp.experts`` on ``"cpu"`` under a layer on a GPU (:mod:`planner.placement.sub_layer`): the
experts hold most of a MoE model's bytes, and a decode step uses only the few its tokens are routed to. Streaming
them to the GPU would copy all of them on every step; instead the hidden states, the router's choice and weights go
to the host, the experts run there (only those that were hit, on the native CPU kernels where the layout and dtype
allow: :mod:`loaders.native.experts`), and the result goes back to the device the layer computes on. Nothing is
streamed and no weight leaves host RAM.

A plan may also let the CPU compute whole layers that did not fit the GPUs even without their experts (and the
norm and head after them): the plan lists every such key in ``Plan.cpu_compute``. Their KV cache then lives in
host RAM too (caches are created on the device of the keys they are handed).

A ``cpu`` entry naming an ``.experts`` module that holds tensors of its own is computed on the CPU even without a
plan (a hand-written map); any other ``cpu`` entry is streamed to the first GPU, as in transformers, unless the
plan lists it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

import torch

from loaders.checkpoint.device_order import cpu_compute_entries, cpu_expert_entries
from loaders.native.experts import install_expert_kernels, native_experts_forward
from loaders.native.linear import NativeCPULinear, use_native_linears
from loaders.run.streaming import install_gpu_execution, move_to
from planner.errors import PlanError
from planner.placement.hf_device_map import covering_key
from planner.types import DeviceId

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def _to_host(module, args, kwargs):
    first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
    module._loadmaster_return_device = first.device if first is not None else _CPU
    return move_to(args, _CPU), move_to(kwargs, _CPU)


def _back(module, args, output):
    return move_to(output, getattr(module, "_loadmaster_return_device", _CPU))


def install_cpu_experts(model: torch.nn.Module, keys: list[str], cpu_kernels: str = "auto") -> int:
    """Hooks that run each module of ``keys`` on the CPU: inputs to the host, outputs back to the device its caller
    computes on. Buffers built on the execution device (non-persistent ones, placed with the streamed blocks) come
    back to the host first. Routed experts then run on the native CPU kernels (:mod:`loaders.native.experts`), and
    the linear layers of whole modules computed here too (:mod:`loaders.native.linear`), as ``cpu_kernels`` says
    ("auto", "native" or "torch"). Returns how many experts modules and linear layers were switched."""
    handles = []
    for key in keys:
        module = model.get_submodule(key)
        for sub in module.modules():
            for leaf, buf in list(sub._buffers.items()):
                if buf is not None and buf.device != _CPU:
                    sub._buffers[leaf] = buf.to(_CPU)
        handles.append(module.register_forward_pre_hook(_to_host, with_kwargs=True))
        handles.append(module.register_forward_hook(_back))
    model._loadmaster_cpu_hooks = handles
    experts = experts_keys(keys, model)
    native = install_expert_kernels([model.get_submodule(k) for k in experts], cpu_kernels)
    for key in keys:
        if key not in experts:
            native += use_native_linears(model.get_submodule(key), cpu_kernels)
    if keys:
        log.info("%d module(s) compute on the CPU; %d run on the native CPU kernels", len(keys), native)
    return native


def experts_keys(keys: list[str], model: torch.nn.Module) -> list[str]:
    """The routed-experts modules among ``keys``."""
    return [k for k in keys if k in cpu_expert_entries(model, {k: "cpu"})]


def native_cpu_modules(model: torch.nn.Module) -> int:
    """How many modules of ``model`` run on the native CPU kernels: linear layers and routed-experts modules."""
    return sum(
        1
        for m in model.modules()
        if isinstance(m, NativeCPULinear) or getattr(m.forward, "__func__", None) is native_experts_forward
    )


def _check_not_streamed(model: torch.nn.Module, keys: list[str], rest: Mapping[str, DeviceId]) -> None:
    """A module the CPU computes must not fall under a broader ``cpu``/``disk`` key of the rest of the map, which
    would stream it to the GPU as well."""
    for key in keys:
        for name, _ in model.get_submodule(key).named_parameters(prefix=key):
            cover = covering_key(name, rest)
            if cover is not None and rest[cover] in ("cpu", "disk"):
                raise PlanError(
                    f"{key!r} computes on the CPU, but the device map's broader key {cover!r} ({rest[cover]}) would "
                    f"also stream it to the GPU; give {cover!r}'s other modules keys of their own"
                )


def install_gpu_execution_with_cpu_experts(
    model: torch.nn.Module,
    device_map: Mapping[str, DeviceId],
    placement: Mapping[str, DeviceId],
    exec_device: torch.device,
    cpu_compute: Collection[str] = (),
    cpu_kernels: str = "auto",
    **kwargs,
):
    """:func:`loaders.run.streaming.install_gpu_execution` for a map where some modules compute on the CPU (routed
    experts, and the plan's ``cpu_compute`` keys): those are left out of the map the GPU wiring sees, so they are
    neither aligned to a GPU nor streamed, then hooked to run on the host, on the native kernels as ``cpu_kernels``
    says. ``kwargs``: backend and gpu_device stand-ins, as install_gpu_execution takes them. Returns its
    streamer."""
    keys = cpu_compute_entries(model, device_map, cpu_compute)
    rest = {k: v for k, v in device_map.items() if k not in keys}
    _check_not_streamed(model, keys, rest)
    streamer = install_gpu_execution(model, rest, placement, exec_device, **kwargs)
    install_cpu_experts(model, keys, cpu_kernels)
    return streamer


__all__ = [
    "install_cpu_experts",
    "install_gpu_execution_with_cpu_experts",
    "native_cpu_modules",
]
