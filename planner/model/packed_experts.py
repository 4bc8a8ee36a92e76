"""The meta model of an MXFP4 checkpoint's fused MoE experts (gpt-oss): each experts module holds its tensors as
stored.

gpt-oss ships its routed experts, and only them, in MXFP4: per MoE layer ``<experts>.gate_up_proj_blocks`` uint8
``[E, 2I, H/32, 16]`` with ``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]``, and ``down_proj_blocks`` ``[E, H,
I/32, 16]`` with ``down_proj_scales`` ``[E, H, I/32]``, beside float ``gate_up_proj_bias`` ``[E, 2I]`` and
``down_proj_bias`` ``[E, H]``. Expert ``e``'s slice of each pair is a linear layer's weight ``[N, K]`` in the MXFP4
linear layout (:mod:`planner.model.quant_config`), which transformers' ``GptOssExperts`` holds transposed as a
float parameter (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``).

:func:`swap_packed_experts` replaces every such experts module with a :class:`PackedExperts` on the meta device:
the four stored tensors as buffers in their stored shape and dtype, the biases as the module's own parameters. The
walk (:mod:`planner.model.meta_skeleton`) marks the buffers ``packed``, so the plan sizes them to the byte as
stored, and the loader fills them from the shards (a disk layer's are maps of the shard) and makes the runnable
module (:mod:`loaders.native.mxfp4_experts`). Imports torch: only the meta walk reads this.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from planner.errors import PlanError
from planner.model.quant_config import MXFP4_BLOCK, MXFP4_LAYOUT, QuantFormat
from planner.model.safetensors_header import HeaderTensor

#: The projections of a fused experts module, and for each the stored pair's suffixes.
PROJECTIONS = ("gate_up_proj", "down_proj")


class PackedExperts(nn.Module):
    """A fused MoE experts module of an MXFP4 checkpoint, as stored: not runnable until the loader replaces it.

    It keeps what the runnable module needs of the original (``GptOssExperts``): the counts, and the gate's
    ``alpha`` and ``limit``."""

    #: Read by the walk (``packed`` tensors, sized as stored) and the loader (kept in their stored dtype).
    loadmaster_packed = True

    def __init__(self, fmt: QuantFormat, source: nn.Module, stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
        super().__init__()
        self.fmt = fmt
        self.num_experts = int(source.num_experts)
        self.hidden_size = int(source.hidden_size)
        self.intermediate_size = int(source.intermediate_size)
        self.alpha = float(source.alpha)
        self.limit = float(source.limit)
        for name, (shape, dtype) in stored.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))
        self.gate_up_proj_bias = source.gate_up_proj_bias
        self.down_proj_bias = source.down_proj_bias

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError(f"{self.fmt.describe} experts run only once the loader has replaced them")

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, {self.fmt.describe}"
        )


def expected_expert_shapes(num_experts: int, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """The stored shape of each MXFP4 tensor of a fused experts module (gpt-oss's layout)."""
    half = MXFP4_BLOCK // 2
    out = {}
    for proj, (n, k) in zip(PROJECTIONS, ((2 * intermediate, hidden), (hidden, intermediate)), strict=True):
        out[f"{proj}_blocks"] = (num_experts, n, k // MXFP4_BLOCK, half)
        out[f"{proj}_scales"] = (num_experts, n, k // MXFP4_BLOCK)
    return out


def _is_gpt_oss_experts(mod: nn.Module) -> bool:
    """Whether ``mod`` is laid out as gpt-oss's experts: transposed fused projections with biases and a clamped
    gate (``alpha``, ``limit``), the forward :class:`loaders.native.mxfp4_experts.Mxfp4Experts` computes."""
    gate_up, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and isinstance(getattr(mod, "gate_up_proj_bias", None), torch.Tensor)
        and isinstance(getattr(mod, "down_proj_bias", None), torch.Tensor)
        and all(hasattr(mod, a) for a in ("alpha", "limit", "num_experts", "hidden_size", "intermediate_size"))
        and tuple(gate_up.shape) == (mod.num_experts, mod.hidden_size, 2 * mod.intermediate_size)
    )


def _check_shapes(name: str, mod: nn.Module, stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    for k in (mod.hidden_size, mod.intermediate_size):
        if k % MXFP4_BLOCK:
            raise PlanError(
                f"{name}: hidden_size {mod.hidden_size} and intermediate_size {mod.intermediate_size} must be "
                f"multiples of {MXFP4_BLOCK} to hold whole MXFP4 blocks: the checkpoint disagrees with config.json."
            )
    for suffix, shape in expected_expert_shapes(mod.num_experts, mod.hidden_size, mod.intermediate_size).items():
        got = stored.get(suffix)
        if got is None:
            raise PlanError(
                f"{name}.{suffix} is missing: MXFP4 experts store gate_up_proj_blocks, gate_up_proj_scales, "
                "down_proj_blocks and down_proj_scales (gpt-oss's layout). Re-save the checkpoint whole."
            )
        if tuple(got[0]) != shape or got[1] is not torch.uint8:
            raise PlanError(
                f"{name}.{suffix} is stored as {str(got[1]).removeprefix('torch.')} {list(got[0])}, but "
                f"{mod.num_experts} MXFP4 experts of hidden_size {mod.hidden_size} and intermediate_size "
                f"{mod.intermediate_size} store uint8 {list(shape)}: the checkpoint disagrees with config.json."
            )


def swap_packed_experts(model: nn.Module, fmt: QuantFormat, headers: Mapping[str, HeaderTensor]) -> int:
    """Replace the fused experts modules whose checkpoint stores ``<name>.gate_up_proj_blocks`` with
    :class:`PackedExperts`; returns how many. Blocks stored for experts of another layout are a :class:`PlanError`
    naming the module, since no forward here computes them."""
    if fmt.layout != MXFP4_LAYOUT:
        return 0
    swapped = 0
    for name, mod in list(model.named_modules()):
        if f"{name}.gate_up_proj_blocks" not in headers:
            continue
        if not _is_gpt_oss_experts(mod):
            raise PlanError(
                f"{name}.gate_up_proj_blocks: MXFP4 experts are loaded in gpt-oss's layout (transposed fused "
                f"projections with biases and a clamped gate), and {name} is a {type(mod).__name__}; supported: "
                "gpt-oss's experts and <linear>.weight_blocks."
            )
        stored = {
            f"{proj}_{part}": (tuple(headers[key].shape), getattr(torch, headers[key].dtype))
            for proj in PROJECTIONS
            for part in ("blocks", "scales")
            if (key := f"{name}.{proj}_{part}") in headers
        }
        _check_shapes(name, mod, stored)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PackedExperts(fmt, mod, stored))
        swapped += 1
    return swapped
