"""FP8 linear layers on the CPU: the checkpoint's e4m3 bytes read in place by the native FP8 kernel.

An FP8 checkpoint stores each quantized layer's ``weight`` as float8_e4m3fn ``[N, K]`` and its scales as
``weight_scale`` (compressed-tensors ``float-quantized``: per output channel, per tensor, or per group of inputs)
or ``weight_scale_inv`` (``fp8`` block-wise, one float per ``[128 rows x 128 inputs]`` block, as DeepSeek-V3 and
Qwen3-FP8 ship it). :class:`Fp8CPULinear` keeps the stored weight tensor itself (on a disk tier a map of the shard,
so a token streams one byte per weight from the file) and the scales as float32 ``[ceil(N/bn), ceil(K/bk)]``, and
multiplies with ``loadmaster::linear_fp8`` (``kernels/linear_fp8.c``), which converts the bytes in registers.

Decode rows (one token per row, up to the kernel's 32 rows) run on the kernel; prompts in bfloat16 (several tokens
per row) run on torch's GEMM over the weight dequantized a tile at a time, as the float layers do
(:mod:`loaders.native.linear`: a row's result then does not depend on which rows share its call). Where the native
kernels are not loaded, every product takes that torch path.
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.native import operators
from planner.model.packed_linear import PackedLinear
from planner.model.quant_config import QuantFormat


def fp8_scales(m: PackedLinear, fmt: QuantFormat) -> tuple[torch.Tensor, int, int] | None:
    """A stored FP8 layer's scales as float32 ``[ceil(N/bn), ceil(K/bk)]`` with their block ``(bn, bk)``, or None
    when the kernel does not take its grid (a block of inputs not a multiple of 64 that leaves a row several)."""
    n, k = m.out_features, m.in_features
    if fmt.layout == "fp8-block":
        bn, bk = fmt.block or (128, 128)
        s = m.weight_scale_inv.to(torch.float32).reshape(-(-n // bn), -(-k // bk))
    else:
        s = m.weight_scale.to(torch.float32)
        if s.numel() == 1:
            s, bn, bk = s.reshape(1, 1), n, k
        else:
            s = s.reshape(n, -1)
            bn, bk = 1, -(-k // s.shape[1]) if fmt.group_size <= 0 else fmt.group_size
    if bk < k and bk % operators.FP8_SPAN_MULTIPLE:
        return None
    return s.contiguous(), bn, min(bk, k)


class Fp8CPULinear(nn.Module):
    """A linear layer holding FP8 e4m3 weights as stored and float32 scales per block (see the module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: torch.Tensor,
        scales: torch.Tensor,
        block: tuple[int, int],
        bias: torch.Tensor | None,
    ):
        super().__init__()
        if weight.dtype is not torch.float8_e4m3fn or tuple(weight.shape) != (out_features, in_features):
            raise ValueError(
                f"an FP8 layer's weight must be float8_e4m3fn [{out_features}, {in_features}], "
                f"not {weight.dtype} {tuple(weight.shape)}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.block_rows, self.block_cols = block
        self.register_buffer("weight", weight if weight.stride(1) == 1 else weight.contiguous())
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_packed(cls, m: PackedLinear) -> Fp8CPULinear | None:
        """The layer for a stored FP8 layer, or None where the kernel does not take its scale grid."""
        grid = fp8_scales(m, m.fmt)
        if grid is None:
            return None
        scales, bn, bk = grid
        bias = m.bias.detach() if m.bias is not None else None
        return cls(m.in_features, m.out_features, m.weight, scales, (bn, bk), bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return operators.dequantize_fp8(self.weight, self.scales, self.block_rows, self.block_cols, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        args = (self.weight, self.scales, self.bias, self.block_rows, self.block_cols)
        if input.dtype is torch.bfloat16 and input.dim() >= 3 and input.shape[-2] > 1:
            return operators.linear_fp8_torch(input, *args)  # a prompt: see the module docstring
        return operators.linear_fp8(input, *args)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, "
            f"scales per {self.block_rows}x{self.block_cols}"
        )
