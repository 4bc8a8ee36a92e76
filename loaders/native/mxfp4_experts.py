"""gpt-oss's MXFP4 experts on the CPU: each hit expert's blocks and e8m0 scales read in place by the MXFP4 kernel.

gpt-oss stores its routed experts, and only them, in MXFP4 (:mod:`planner.model.packed_experts` has the layout).
Expert ``e``'s slice of ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` is a linear weight ``[2I, H]`` in the layout
``loadmaster::linear_mxfp4`` reads (``kernels/linear_mxfp4.c``), and likewise ``down_proj_blocks`` ``[H, I]``, so
:class:`Mxfp4Experts` runs transformers' eager ``GptOssExperts.forward`` (each hit expert in ascending order, on
the rows routed to it: ``gate_up = x W_gu^T + b``, the clamped gate on its interleaved halves, ``down = g W_d^T +
b``, weighted and summed) with each product on that kernel. Nothing is repacked or dequantized at load: a decode
step reads half a byte per weight of the experts its tokens were sent to (on a disk tier, from the shard's map).

Where GPUs compute (``native=False``), the experts are dequantized once to float parameters on their device and
the same forward multiplies them with torch (:func:`dequantized_experts`); the log says so.
"""

from __future__ import annotations

import torch
from torch import nn

from loaders.native import operators
from planner.model.packed_experts import PROJECTIONS, PackedExperts


class Mxfp4Experts(nn.Module):
    """A fused MoE experts module computing from MXFP4 blocks as stored (see the module docstring), or from the
    float weights they stand for (``weights``: ``{proj: [E, N, K]}``) where no native kernel computes."""

    def __init__(self, packed: PackedExperts, weights: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.num_experts = packed.num_experts
        self.hidden_size = packed.hidden_size
        self.intermediate_size = packed.intermediate_size
        self.alpha = packed.alpha
        self.limit = packed.limit
        for proj in PROJECTIONS:
            if weights is None:
                self.register_buffer(f"{proj}_blocks", getattr(packed, f"{proj}_blocks"))
                self.register_buffer(f"{proj}_scales", getattr(packed, f"{proj}_scales"))
            else:
                setattr(self, f"{proj}_weight", nn.Parameter(weights[proj], requires_grad=False))
            setattr(self, f"{proj}_bias", nn.Parameter(getattr(packed, f"{proj}_bias").detach(), requires_grad=False))
        self.packed = weights is None

    def _product(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        bias = getattr(self, f"{proj}_bias")[expert].to(x.dtype)
        if self.packed:
            blocks, scales = getattr(self, f"{proj}_blocks")[expert], getattr(self, f"{proj}_scales")[expert]
            return operators.linear_mxfp4(x, blocks, scales, bias)
        return torch.nn.functional.linear(x, getattr(self, f"{proj}_weight")[expert].to(x.dtype), bias)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's gate, as ``GptOssExperts._apply_gate``: interleaved gate and up halves, clamped."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(
        self, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> torch.Tensor:
        """Each (row, expert) pair grouped by expert, ascending: two products per hit expert, and the gate, the
        routing weights and the sum once over all pairs (a decode step's four experts cost four gates' worth of
        small torch calls otherwise, as much time as their products)."""
        top_k = router_indices.shape[1]
        flat = router_indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] < self.num_experts]  # transformers' masking index, if any, computes nothing
        if order.numel() == 0:
            return torch.zeros_like(hidden_states)
        counts = torch.bincount(flat[order], minlength=self.num_experts).tolist()
        token_idx = order // top_k
        x = hidden_states.index_select(0, token_idx)
        gated = self._apply_gate(self._by_expert(x, counts, "gate_up_proj"))
        y = self._by_expert(gated.contiguous(), counts, "down_proj")
        y = y * routing_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token_idx, y.to(hidden_states.dtype))

    def _by_expert(self, x: torch.Tensor, counts: list[int], proj: str) -> torch.Tensor:
        """``proj`` of each run of ``x``'s rows by its expert (``counts[e]`` rows of expert ``e``, in order)."""
        out, start = [], 0
        for expert, n in enumerate(counts):
            if n:
                out.append(self._product(x[start : start + n], proj, expert))
                start += n
        return torch.cat(out) if len(out) > 1 else out[0]

    def extra_repr(self) -> str:
        kind = "mxfp4 e2m1, e8m0 scales per 32" if self.packed else "dequantized from mxfp4"
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, {kind}"


def dequantized_experts(packed: PackedExperts, dtype: torch.dtype) -> Mxfp4Experts:
    """The experts with their weights dequantized to ``dtype`` on the blocks' device (where GPUs compute)."""
    weights = {}
    for proj in PROJECTIONS:
        blocks, scales = getattr(packed, f"{proj}_blocks"), getattr(packed, f"{proj}_scales")
        e, n, nb, half = blocks.shape
        flat = operators.dequantize_mxfp4(blocks.reshape(e * n, nb, half), scales.reshape(e * n, nb), dtype)
        weights[proj] = flat.view(e, n, nb * operators.MXFP4_BLOCK)
    return Mxfp4Experts(packed, weights)
