"""Routed experts that compute on the CPU, on the native CPU kernels (:mod:`loaders.native.operators`).

transformers 5 keeps a MoE layer's experts as fused 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``) and its eager forward multiplies each hit expert's slice with ``F.linear``, i.e. torch's GEMM. A decode
step hands each expert a handful of rows, the case the native kernels are made for (they read the weight once at
memory speed where torch's GEMM is tuned for large products), so experts kept on the CPU beside GPUs
(:mod:`loaders.run.cpu_experts`) run the same algorithm with each product sent to ``loadmaster::linear`` where
:func:`loaders.native.operators.supports` takes it, and to ``F.linear`` otherwise (long prefills, other dtypes, autograd).

Only the layout the eager forward computes with plain products is taken over: concatenated gate and up, not
transposed, no biases, no per-expert norm (Mixtral, Qwen-MoE, Qwen3-MoE, DeepSeek-V3). GPT-OSS's (transposed, with
biases and a clamped gate) is laid out for the kernel at load where resident (:mod:`loaders.native.gpt_oss_experts`);
others keep transformers' forward. The gate itself is the module's own ``_apply_gate``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable

import torch
from torch.nn import functional as F

from loaders.native import kernel_build, operators
from loaders.native.gpt_oss_experts import takes_transposed

log = logging.getLogger(__name__)


def takes_native_kernels(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a fused experts module in the layout :func:`native_experts_forward` computes, with
    weights in a dtype the native kernels have."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_post_expert_norm", True)
        and callable(getattr(module, "_apply_gate", None))
        and gate_up.dtype in kernel_build.KERNELS
        and down.dtype == gate_up.dtype
    )


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return operators.linear(x, weight, None) if operators.supports(x, weight) else F.linear(x, weight)


def native_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager experts forward (each hit expert, in ascending order, on the rows routed to it, weighted
    and summed into the output), with each product on the native kernel where it takes the operands."""
    if hidden_states.device.type != "cpu" or hidden_states.dtype != self.gate_up_proj.dtype:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        hit = torch.unique(top_k_index).tolist()
    for expert in hit:
        if not 0 <= expert < self.num_experts:  # transformers' sentinel for a masked choice
            continue
        token_idx, top_k_pos = torch.where(top_k_index == expert)
        state = hidden_states[token_idx]
        gated = self._apply_gate(_linear(state, self.gate_up_proj[expert]))
        expert_out = _linear(gated, self.down_proj[expert]) * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, expert_out.to(out.dtype))
    return out


def install_expert_kernels(modules: Iterable[torch.nn.Module], choice: str = "auto") -> int:
    """Run each experts module of ``modules`` on the native kernels where its layout and dtype allow; return how
    many were switched. ``choice`` as :func:`loaders.native.linear.use_native_linears` takes it: ``"auto"`` switches
    where the kernel is available, ``"native"`` raises where it is not, ``"torch"`` switches nothing."""
    if choice == "torch":
        return 0
    switched, kept = 0, set()
    for module in modules:
        if not takes_native_kernels(module):
            if not takes_transposed(module):  # those are laid out for the kernel after (gpt_oss_experts)
                kept.add(type(module).__name__)
            continue
        dtype = module.gate_up_proj.dtype
        st = kernel_build.status(dtype)
        if not st.available:
            if choice == "native":
                raise RuntimeError(
                    f"cpu_kernels='native' was asked for, but for {str(dtype).removeprefix('torch.')}: {st.reason}. "
                    "Use 'auto' or 'torch'."
                )
            continue
        module.forward = types.MethodType(native_experts_forward, module)
        switched += 1
    for name in sorted(kept):
        log.info("%s keeps its own experts forward (layout not taken by the native experts path)", name)
    return switched


__all__ = ["install_expert_kernels", "native_experts_forward", "takes_native_kernels"]
