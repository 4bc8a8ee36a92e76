"""Decode-time linear layers on the CPU through the native kernel, with the model otherwise untouched.

:func:`use_native_linears` changes the class of each eligible ``nn.Linear`` to :class:`NativeCPULinear`, a
subclass whose ``forward`` sends decode-sized bf16 products on the CPU to :mod:`loaders.cpu_kernels` and
everything else (prefill, other dtypes, GPU inputs, autograd) to ``nn.Linear.forward``. Parameters are not
copied or moved: ``state_dict``, tied weights, memory accounting and zero-copy ``"disk"`` weights (views of the
shard maps) are exactly as they were.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from loaders import cpu_kernels

log = logging.getLogger(__name__)

#: Values of ``load_model(cpu_kernels=...)``.
CPU_KERNEL_CHOICES = ("auto", "native", "torch")


class NativeCPULinear(nn.Linear):
    """An ``nn.Linear`` whose small bf16 CPU products run on the native kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        if cpu_kernels.supports(input, self.weight):
            return cpu_kernels.linear_bf16(input, self.weight, self.bias)
        return super().forward(input)


def use_native_linears(model: nn.Module, choice: str = "auto") -> int:
    """Switch eligible linear layers to the native kernel; return how many were switched.

    ``"auto"`` switches when the kernel is available and quietly keeps torch otherwise; ``"native"`` raises
    when it is not; ``"torch"`` switches nothing. Eligible: exactly ``nn.Linear`` (not a quantized or
    otherwise specialised subclass) with a bf16 weight on the CPU or a memory map.
    """
    if choice not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernels={choice!r} is not one of {', '.join(CPU_KERNEL_CHOICES)}.")
    if choice == "torch":
        return 0
    candidates = [m for m in model.modules()
                  if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    if not candidates:
        return 0
    st = cpu_kernels.status()
    if not st.available:
        if choice == "native":
            raise RuntimeError(f"cpu_kernels='native' was asked for, but {st.reason}. Use 'auto' or 'torch'.")
        log.info("bf16 linear layers stay on torch: %s", st.reason)
        return 0
    for m in candidates:
        m.__class__ = NativeCPULinear
    log.info("%d bf16 linear layers run on the native CPU kernel", len(candidates))
    return len(candidates)
