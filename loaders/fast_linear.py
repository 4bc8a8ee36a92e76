"""Decode-time linear layers on the CPU through the native kernels, with the model otherwise untouched.

:func:`use_native_linears` changes the class of each eligible ``nn.Linear`` to :class:`NativeCPULinear`, a
subclass whose ``forward`` sends small bf16 and fp32 products on the CPU to the ``loadmaster::linear`` operator
(:mod:`loaders.kernel_ops`, backed by :mod:`loaders.cpu_kernels`) and
everything else (long prefills, other dtypes, GPU inputs, autograd) to ``nn.Linear.forward``. Parameters are not
copied or moved: ``state_dict``, tied weights, memory accounting and zero-copy ``"disk"`` weights (views of the
shard maps) are exactly as they were.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loaders import cpu_kernels, kernel_ops

log = logging.getLogger(__name__)

#: Values of ``load_model(cpu_kernels=...)``.
CPU_KERNEL_CHOICES = ("auto", "native", "torch")


class NativeCPULinear(nn.Linear):
    """An ``nn.Linear`` whose small CPU products (bf16 or fp32) run on the native kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        if kernel_ops.supports(input, self.weight):
            return kernel_ops.linear(input, self.weight, self.bias)
        return super().forward(input)


def use_native_linears(model: nn.Module, choice: str = "auto") -> int:
    """Switch eligible linear layers to the native kernels; return how many were switched.

    ``"auto"`` switches where the kernel for the weight's dtype is available and quietly keeps torch otherwise;
    ``"native"`` raises when it is not; ``"torch"`` switches nothing. Eligible: exactly ``nn.Linear`` (not a
    quantized or otherwise specialised subclass) with a bf16 or fp32 weight on the CPU or a memory map.
    """
    if choice not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernels={choice!r} is not one of {', '.join(CPU_KERNEL_CHOICES)}.")
    if choice == "torch":
        return 0
    by_dtype: dict[torch.dtype, list[nn.Linear]] = {}
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype in cpu_kernels.KERNELS and m.weight.device.type == "cpu":
            by_dtype.setdefault(m.weight.dtype, []).append(m)
    switched = 0
    for dtype, mods in by_dtype.items():
        st = cpu_kernels.status(dtype)
        name = str(dtype).removeprefix("torch.")
        if not st.available:
            if choice == "native":
                raise RuntimeError(
                    f"cpu_kernels='native' was asked for, but for {name}: {st.reason}. Use 'auto' or 'torch'."
                )
            log.info("%s linear layers stay on torch: %s", name, st.reason)
            continue
        for m in mods:
            m.__class__ = NativeCPULinear
        switched += len(mods)
        log.info("%d %s linear layers run on the native CPU kernel (%s path)", len(mods), name, st.isa)
    return switched
