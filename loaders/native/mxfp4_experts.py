"""gpt-oss's MXFP4 experts on the CPU: each hit expert's blocks and e8m0 scales read in place by the MXFP4 kernel.

gpt-oss stores its routed experts, and only them, in MXFP4 (:mod:`planner.model.packed_experts` has the layout).
Expert ``e``'s slice of ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` is a linear weight ``[2I, H]`` in the layout
``loadmaster::linear_mxfp4`` reads (``kernels/linear_mxfp4.c``), and likewise ``down_proj_blocks`` ``[H, I]``, so
:class:`Mxfp4Experts` runs transformers' eager ``GptOssExperts.forward``
(:class:`~loaders.native.gpt_oss_experts.GptOssRoutedExperts`) with each product on that kernel. Nothing is
repacked or dequantized at load: a decode step reads half a byte per weight of the experts its tokens were sent to
(on a disk tier, from the shard's map).

Where GPUs compute (``native=False``), the experts are dequantized once to float parameters on their device and
multiplied by torch (:func:`dequantized_experts`, a :class:`~loaders.native.gpt_oss_experts.FloatGptOssExperts`);
the log says so.
"""

from __future__ import annotations

import torch

from loaders.native import operators
from loaders.native.gpt_oss_experts import FloatGptOssExperts, GptOssRoutedExperts
from planner.model.packed_experts import PROJECTIONS, PackedExperts


class Mxfp4Experts(GptOssRoutedExperts):
    """A fused MoE experts module computing from MXFP4 blocks as stored (see the module docstring)."""

    def __init__(self, packed: PackedExperts):
        super().__init__(packed)
        for proj in PROJECTIONS:
            self.register_buffer(f"{proj}_blocks", getattr(packed, f"{proj}_blocks"))
            self.register_buffer(f"{proj}_scales", getattr(packed, f"{proj}_scales"))

    def _product(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        bias = getattr(self, f"{proj}_bias")[expert].to(x.dtype)
        blocks, scales = getattr(self, f"{proj}_blocks")[expert], getattr(self, f"{proj}_scales")[expert]
        return operators.linear_mxfp4(x, blocks, scales, bias)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, mxfp4 e2m1, e8m0 scales per 32"


def dequantized_experts(packed: PackedExperts, dtype: torch.dtype) -> FloatGptOssExperts:
    """The experts with their weights dequantized to ``dtype`` on the blocks' device (where GPUs compute)."""
    weights = {}
    for proj in PROJECTIONS:
        blocks, scales = getattr(packed, f"{proj}_blocks"), getattr(packed, f"{proj}_scales")
        e, n, nb, half = blocks.shape
        flat = operators.dequantize_mxfp4(blocks.reshape(e * n, nb, half), scales.reshape(e * n, nb), dtype)
        weights[proj] = flat.view(e, n, nb * operators.MXFP4_BLOCK)
    return FloatGptOssExperts(packed, weights)
