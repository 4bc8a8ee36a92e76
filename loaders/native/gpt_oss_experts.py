"""gpt-oss's routed experts on the native CPU kernels, from float weights: a bf16 or fp32 checkpoint's, or MXFP4's
dequantized where GPUs compute.

Why: transformers' ``GptOssExperts`` keeps its weights transposed (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I,
H]``) and, on the CPU, multiplies them with torch's GEMM, by default once per expert of the layer whether its tokens
were sent there or not (``grouped_mm``: 64 products a layer for gpt-oss's 32 experts). The native float kernel
reads a weight ``[N, K]`` row by row at memory speed, so :func:`transposed_experts` lays a resident module's
weights out that way once, at load (a copy of the experts' bytes, the original pages given back to the page
cache), and :class:`FloatGptOssExperts` computes the eager forward on the hit experts only. On the gpt-oss bench
model (bf16, 8 layers of 32 experts, a 2-core Zen 4): 21.4 ms a token against 38.6 through transformers' forward, the
same greedy tokens; the layout took 3.6 s for its 1.5 GB of experts.

The forward both forms share (:class:`GptOssRoutedExperts`) is transformers' eager one: each (row, expert) pair
grouped by expert in ascending order, ``gate_up = x W_gu^T + b``, the clamped gate on its interleaved halves,
``down = g W_d^T + b``, weighted and summed; the gate, the routing weights and the sum run once over all pairs.
Disk experts keep transformers' forward: laying them out would copy the disk tier into memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from loaders.native import kernel_build, operators
from planner.model.packed_experts import PROJECTIONS

log = logging.getLogger(__name__)


class GptOssRoutedExperts(nn.Module):
    """gpt-oss's experts forward with each product on a kernel a subclass names (:meth:`_product`). ``source`` is
    the module it stands for (transformers' ``GptOssExperts`` or a checkpoint's ``PackedExperts``): its counts, its
    gate's ``alpha`` and ``limit``, and its biases ``{proj}_bias [E, N]``."""

    def __init__(self, source: nn.Module):
        super().__init__()
        self.num_experts = int(source.num_experts)
        self.hidden_size = int(source.hidden_size)
        self.intermediate_size = int(source.intermediate_size)
        self.alpha = float(source.alpha)
        self.limit = float(source.limit)
        for proj in PROJECTIONS:
            bias = getattr(source, f"{proj}_bias").detach()
            setattr(self, f"{proj}_bias", nn.Parameter(bias, requires_grad=False))

    def _product(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        """``x W^T + b`` of expert ``expert``'s ``proj``."""
        raise NotImplementedError

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


class FloatGptOssExperts(GptOssRoutedExperts):
    """The experts from float weights ``{proj: [E, N, K]}`` (``source``'s biases): each product on the native float
    kernel where it takes the operands (a decode step's few CPU rows), else torch's (prompts, GPUs)."""

    def __init__(self, source: nn.Module, weights: dict[str, torch.Tensor]):
        super().__init__(source)
        for proj in PROJECTIONS:
            setattr(self, f"{proj}_weight", nn.Parameter(weights[proj], requires_grad=False))

    def _product(self, x: torch.Tensor, proj: str, expert: int) -> torch.Tensor:
        weight = getattr(self, f"{proj}_weight")[expert]
        bias = getattr(self, f"{proj}_bias")[expert].to(x.dtype)
        if operators.supports(x, weight):
            return operators.linear(x, weight, bias)
        return F.linear(x, weight.to(x.dtype), bias)

    def extra_repr(self) -> str:
        dtype = str(self.gate_up_proj_weight.dtype).removeprefix("torch.")
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, {dtype} [E, N, K]"


def takes_transposed(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers GptOssExperts with float weights on the CPU in a native kernel's
    dtype: transposed, with biases, the gate and up halves interleaved."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        type(module).__name__ == "GptOssExperts"
        and isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.is_cpu
        and down.is_cpu
        and gate_up.dtype in kernel_build.KERNELS
        and down.dtype == gate_up.dtype
        and all(isinstance(getattr(module, f"{p}_bias", None), torch.Tensor) for p in PROJECTIONS)
    )


def transposed_experts(module: nn.Module) -> FloatGptOssExperts:
    """``module`` (see :func:`takes_transposed`) with its weights laid out ``[E, N, K]`` for the native kernel."""
    weights = {p: getattr(module, p).detach().transpose(1, 2).contiguous() for p in PROJECTIONS}
    return FloatGptOssExperts(module, weights)


def install_transposed_experts(
    model: nn.Module, skip: Iterable[str] = (), release: Callable[[torch.Tensor], None] | None = None
) -> int:
    """Replace each resident GptOssExperts module of ``model`` (not named in ``skip``: those on disk) by
    :func:`transposed_experts` where the native float kernel builds here, one at a time, handing each original
    weight to ``release`` once replaced (a shard map's pages back to the page cache), so that at most one
    module's experts are held twice at once; return how many."""
    skipped = set(skip)
    names = [n for n, m in model.named_modules() if n not in skipped and takes_transposed(m)]
    if not names or not kernel_build.status(model.get_submodule(names[0]).gate_up_proj.dtype).available:
        return 0
    for name in names:
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(name)
        model.get_submodule(parent).register_module(leaf, transposed_experts(module))
        if release is not None:
            for proj in PROJECTIONS:
                release(getattr(module, proj))
        del module  # the last reference: a cast (not mapped) original is freed before the next is laid out
    log.info("%d gpt-oss experts modules laid out for the native float kernel", len(names))
    return len(names)


__all__ = ["FloatGptOssExperts", "GptOssRoutedExperts", "install_transposed_experts", "transposed_experts"]
