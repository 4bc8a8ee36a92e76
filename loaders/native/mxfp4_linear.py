"""MXFP4 linear layers on the CPU: the checkpoint's e2m1 blocks and e8m0 scales read in place by a native kernel.

An MXFP4 checkpoint (``quant_method: mxfp4``, the gpt-oss layout applied to linear layers) stores each quantized
layer's weight ``W [N, K]`` as ``weight_blocks`` uint8 ``[N, K/32, 16]`` (32 e2m1 codes per block, two a byte, the
even input in the low nibble) and ``weight_scales`` uint8 ``[N, K/32]`` (one e8m0 exponent per block, the scale
``2^(e - 127)``). :class:`Mxfp4CPULinear` keeps both stored tensors themselves (on a disk tier maps of the shard, so
a token streams half a byte per weight plus a byte per 32 from the file) and multiplies with
``loadmaster::linear_mxfp4`` (``kernels/linear_mxfp4.c``), which maps each code through a byte table and sums in
integers as our int4 kernel does (activations rounded to int8 per group of 64, see there), so MXFP4 decodes at int4
speed with no repacking at load.

Decode rows (one token per row, up to the kernel's 32 rows) run on the kernel; prompts in bfloat16 (several tokens
per row) run on torch's GEMM over the weight dequantized a tile at a time (:func:`operators.linear_mxfp4_torch`), as
the FP8 layers do (:mod:`loaders.native.fp8_linear`). Where the native kernels are not loaded, every product takes
that torch path.
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.native import operators
from planner.model.packed_linear import PackedLinear


class Mxfp4CPULinear(nn.Module):
    """A linear layer holding MXFP4 blocks and e8m0 scales as stored (see the module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        blocks: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
    ):
        super().__init__()
        nb, half = in_features // operators.MXFP4_BLOCK, operators.MXFP4_BLOCK // 2
        if (
            in_features % operators.MXFP4_BLOCK
            or blocks.dtype is not torch.uint8
            or blocks.shape != (out_features, nb, half)
        ):
            raise ValueError(
                f"an MXFP4 layer of {out_features}x{in_features} needs uint8 blocks [{out_features}, {nb}, {half}] "
                f"(in_features a multiple of {operators.MXFP4_BLOCK}), not {blocks.dtype} {tuple(blocks.shape)}"
            )
        if scales.dtype is not torch.uint8 or scales.shape != (out_features, nb):
            raise ValueError(
                f"an MXFP4 layer's scales must be uint8 [{out_features}, {nb}], not {scales.dtype} {tuple(scales.shape)}"
            )
        self.in_features = in_features
        self.out_features = out_features
        contiguous_rows = blocks.stride(2) == 1 and blocks.stride(1) == half
        self.register_buffer("blocks", blocks if contiguous_rows else blocks.contiguous())
        self.register_buffer("scales", scales if scales.stride(1) == 1 else scales.contiguous())
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_packed(cls, m: PackedLinear) -> Mxfp4CPULinear:
        """The layer for a stored MXFP4 layer: its ``weight_blocks`` and ``weight_scales`` tensors as they are."""
        bias = m.bias.detach() if m.bias is not None else None
        return cls(m.in_features, m.out_features, m.weight_blocks, m.weight_scales, bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return operators.dequantize_mxfp4(self.blocks, self.scales, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        if input.dtype is torch.bfloat16 and input.dim() >= 3 and input.shape[-2] > 1:
            return operators.linear_mxfp4_torch(input, self.blocks, self.scales, self.bias)  # a prompt
        return operators.linear_mxfp4(input, self.blocks, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4 e2m1, e8m0 scales per 32"
