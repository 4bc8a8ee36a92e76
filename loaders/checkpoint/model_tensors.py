"""Filling a model built on the meta device: setting each tensor, computing non-persistent buffers (rotary
``inv_freq``...) on their real device, and re-tying tied weights. The model itself is built by the planner's
:func:`planner.model.meta_skeleton.build_meta_model`, the one place a config becomes a model class.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def tensor_owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module holding tensor ``name`` and the tensor's name in it: the deepest module on the path, so that a
    packed layer's dotted names (bitsandbytes 4-bit's ``weight.absmax``, see :mod:`planner.model.packed_linear`)
    resolve to the layer and ``weight.absmax``."""
    mod_name, _, leaf = name.rpartition(".")
    while mod_name:
        try:
            return model.get_submodule(mod_name), leaf
        except AttributeError:  # not a module (``weight`` is the layer's tensor): one level up
            mod_name, _, head = mod_name.rpartition(".")
            leaf = f"{head}.{leaf}"
    return model, leaf


def set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` with ``value`` (parameters stay Parameters, without grad)."""
    module, leaf = tensor_owner(model, name)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(name)
    value._is_hf_initialized = True


def non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, module in model.named_modules():
        for leaf, buf in module._buffers.items():
            if buf is not None and leaf in module._non_persistent_buffers_set:
                out[f"{mod_name}.{leaf}" if mod_name else leaf] = buf
    return out


@torch.no_grad()
def init_non_persistent_buffers(model: PreTrainedModel, devices: dict[str, torch.device]) -> None:
    """Give every non-persistent buffer real storage on its device and compute its value.

    The value is computed by the model's own ``initialize_weights`` (the same path transformers' from_pretrained
    takes): every loaded tensor is flagged ``_is_hf_initialized``, so only the fresh buffers are written.
    """
    bufs = non_persistent_buffers(model)
    if not bufs:
        return
    for name, buf in bufs.items():
        module, leaf = tensor_owner(model, name)
        module._buffers[leaf] = torch.empty_like(buf, device=devices.get(name, torch.device("cpu")))
    for p in model.parameters():
        p._is_hf_initialized = True
    for name, b in model.named_buffers():
        if name not in bufs:
            b._is_hf_initialized = True
    model.initialize_weights()


def tie_weights(model: PreTrainedModel) -> None:
    """Re-tie tied parameters (GPT-2's lm_head to wte): the target becomes the very same Parameter as its source."""
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        src_mod, src_leaf = tensor_owner(model, source)
        dst_mod, dst_leaf = tensor_owner(model, target)
        setattr(dst_mod, dst_leaf, getattr(src_mod, src_leaf))
