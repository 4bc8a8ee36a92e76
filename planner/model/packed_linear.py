"""The meta model of a pre-quantized checkpoint: each quantized linear layer holds its tensors as stored.

:func:`swap_packed_linears` replaces every ``nn.Linear`` whose checkpoint stores its format's marker tensor
(:mod:`planner.model.quant_config`) with a :class:`PackedLinear` on the meta device: one buffer per stored tensor
under the layer's name (``qweight``, ``qzeros``, ``scales``, ``g_idx``; ``weight_packed``, ``weight_scale``;
``weight``, ``weight_scale_inv``; ``weight_blocks``, ``weight_scales``, ...), in the stored shape and dtype.

bitsandbytes 4-bit stores tensors *under* the weight's name (``weight``, ``weight.absmax``, ``weight.quant_map``,
``weight.quant_state.bitsandbytes__nf4``, ...): a tensor and tensors below it, which no module tree can hold as
modules and buffers (``weight`` cannot be both). The layer holds them as buffers named by the dotted suffix, as
stored (``register_buffer`` refuses dots, so they go straight into ``_buffers``; torch's ``named_buffers`` and
``state_dict`` take them as they are, and the loader's :func:`loaders.checkpoint.model_tensors.tensor_owner` finds
their owner). So every tensor keeps its stored name, and the plan's names are the checkpoint's keys.

The walk (:mod:`planner.model.meta_skeleton`) marks them ``packed``, so the plan sizes them to the byte as stored,
and the loader fills them from the shards like any tensor (a disk layer's are maps of the shard) and then repacks
each layer once (:mod:`loaders.native.packed_formats`). Imports torch: only the meta walk reads this.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from planner.errors import PlanError
from planner.model.quant_config import QuantFormat, check_stored_shapes
from planner.model.safetensors_header import HeaderTensor


class PackedLinear(nn.Module):
    """A linear layer of a pre-quantized checkpoint, as stored: not runnable until the loader repacks it."""

    #: Read by the walk (``packed`` tensors, sized as stored) and the loader (kept in their stored dtype).
    loadmaster_packed = True

    def __init__(
        self,
        fmt: QuantFormat,
        in_features: int,
        out_features: int,
        stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        bias: nn.Parameter | None,
    ):
        super().__init__()
        self.fmt = fmt
        self.in_features = in_features
        self.out_features = out_features
        for name, (shape, dtype) in stored.items():
            # dotted names (bitsandbytes 4-bit's ``weight.absmax``) bypass register_buffer: see the module docstring
            self._buffers[name] = torch.empty(shape, dtype=dtype, device="meta")
        self.bias = bias

    def stored(self, suffix: str) -> torch.Tensor | None:
        """The stored tensor ``<layer>.<suffix>`` (dotted suffixes included), None if the checkpoint has none."""
        return self._buffers.get(suffix)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        raise RuntimeError(f"a {self.fmt.describe} layer runs only once the loader has repacked it")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt.describe}"


def _stored_of(prefix: str, keys_by_module: Mapping[str, list[str]], headers: Mapping[str, HeaderTensor]):
    out = {}
    for suffix in keys_by_module.get(prefix, ()):
        h = headers[f"{prefix}.{suffix}"]
        out[suffix] = (tuple(h.shape), getattr(torch, h.dtype))
    return out


def swap_packed_linears(model: nn.Module, fmt: QuantFormat, headers: Mapping[str, HeaderTensor]) -> int:
    """Replace the quantized linear layers of a meta ``model`` with :class:`PackedLinear`; returns how many.

    A layer is quantized when ``<name>.<fmt.marker>`` is stored (its other tensors are every ``<name>.<suffix>``
    key but ``bias``); the stored shapes must agree with the layer (else a ``PlanError`` names the tensor)."""
    linears = {name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    keys_by_module = _keys_by_module(headers, linears)
    swapped = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or fmt.marker not in keys_by_module.get(name, ()):
            continue
        stored = _stored_of(name, keys_by_module, headers)
        check_stored_shapes(fmt, name, mod.out_features, mod.in_features, {s: v[0] for s, v in stored.items()})
        packed = PackedLinear(fmt, mod.in_features, mod.out_features, stored, mod.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
        swapped += 1
    if fmt.layout == "mxfp4":
        _refuse_stray_blocks(keys_by_module, model)
    return swapped


def _keys_by_module(headers: Mapping[str, HeaderTensor], linears: set[str]) -> dict[str, list[str]]:
    """Each stored key's suffix, by the module it belongs to: the deepest linear layer whose name prefixes it (a
    suffix may then hold dots: ``weight.absmax``), else the key's parent (``bias`` left out: it stays the layer's
    own parameter)."""
    out: dict[str, list[str]] = {}
    for key in headers:
        mod, _, suffix = key.rpartition(".")
        head = mod
        while head and head not in linears:
            head = head.rpartition(".")[0]
        if head:
            mod, suffix = head, key[len(head) + 1 :]
        if suffix != "bias":
            out.setdefault(mod, []).append(suffix)
    return out


def _refuse_stray_blocks(keys_by_module: Mapping[str, list[str]], model: nn.Module) -> None:
    """MXFP4 blocks stored for something other than a linear layer's weight or gpt-oss's fused experts
    (:mod:`planner.model.packed_experts`, swapped first): a :class:`PlanError` naming the tensor, since nothing would
    load them."""
    for mod, suffixes in keys_by_module.items():
        for suffix in suffixes:
            if suffix.endswith("_blocks") and not getattr(_find(model, mod), "loadmaster_packed", False):
                raise PlanError(
                    f"{mod}.{suffix}: MXFP4 blocks of something other than an nn.Linear weight or gpt-oss's "
                    "fused experts are not loaded by loadmaster yet; supported: <linear>.weight_blocks and "
                    "<linear>.weight_scales, <experts>.gate_up_proj_blocks and the like (gpt-oss)."
                )


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
