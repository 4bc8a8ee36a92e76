"""Attention over the slot cache on the native CPU kernel, registered with transformers as an attention
implementation.

A decode step gives attention one query token per sequence. torch's CPU ``scaled_dot_product_attention`` sets up a
blocked flash-attention pass for each (row, head) for it; ``loadmaster::decode_attention``
(:mod:`loaders.native.operators`, ``kernels/attention_decode.c``) instead reads each (row, KV head)'s keys and values
once, in place in the cache, for all the query heads that share them, and schedules those tasks dynamically over
torch's threads. A row's result depends on its own keys only, so it does not depend on its batch.

Prompt rows (several query tokens, with a mask) take the kernel too, each token over the keys its mask row lets
through. In bfloat16 that is what lets the engine pack prompts of different lengths into one forward
(:mod:`service.engine.model_runner`) and still give each row what it would get alone, whereas SDPA's sums depend on where
a row's keys sit in the packed sequence. In both dtypes it spares a packed forward SDPA's dense pass over every
row's keys (each token reads its own row's only); the engine leaves one long context to SDPA, which is faster there.

:func:`use_native_attention` switches a model from ``"sdpa"`` to :data:`NATIVE_ATTENTION`, an implementation name
that transformers looks up at each forward (``AttentionInterface``; masks are built as for ``"sdpa"``, through
``AttentionMaskInterface``). Calls on the CPU, in fp32 or bf16, with a boolean mask (or, for one query token per
row, none) and nothing else (no dropout, soft-capping, sinks or position bias) go to the kernel; every other call
(GPU layers, other dtypes, additive masks, models that pass extra terms) runs transformers' own ``sdpa`` function
unchanged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from loaders.native import kernel_build, operators

log = logging.getLogger(__name__)

#: The attention implementation name a switched model's config carries.
NATIVE_ATTENTION = "loadmaster_sdpa"
#: Implementations that take the boolean masks transformers builds for ``sdpa``.
BOOL_MASK_ATTENTION = ("sdpa", NATIVE_ATTENTION)

#: Keyword arguments that change what attention computes; a call that sets any of them runs ``sdpa``.
_OTHER_TERMS = ("softcap", "sinks", "s_aux", "position_bias", "output_attentions")


def _kernel_takes(module: nn.Module, query: torch.Tensor, key: torch.Tensor, mask: Any, dropout: float, kwargs) -> bool:
    width = query.shape[2]
    if not query.is_cpu or query.dtype not in (torch.float32, torch.bfloat16):
        return False
    if width != 1 and mask is None:
        return False  # several query tokens: only with the mask saying which keys each attends
    if (dropout and module.training) or any(kwargs.get(k) for k in _OTHER_TERMS):
        return False
    if key.dtype is not query.dtype or key.shape[-1] != query.shape[-1] or query.shape[1] % key.shape[1]:
        return False
    if mask is not None and (
        not isinstance(mask, torch.Tensor)
        or mask.dtype is not torch.bool
        or mask.dim() != 4
        or mask.shape[-1] != key.shape[2]
        or mask.shape[2] not in (1, width)
    ):
        return False
    return operators.decode_available()


def decode_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: the kernel for decode rows, ``sdpa`` for everything else."""
    if _kernel_takes(module, query, key, attention_mask, dropout, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return operators.decode_attention(query, key, value, attention_mask, float(scale)), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


AttentionInterface.register(NATIVE_ATTENTION, decode_attention_forward)
AttentionMaskInterface.register(NATIVE_ATTENTION, sdpa_mask)


def use_native_attention(model: nn.Module) -> bool:
    """Switch a decoder-only model on ``sdpa`` to :data:`NATIVE_ATTENTION` where the native kernels load; return
    whether it was switched. ``LOADMASTER_DECODE_ATTENTION=sdpa`` keeps ``sdpa``."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if os.environ.get("LOADMASTER_DECODE_ATTENTION", "native").strip().lower() == "sdpa":
        log.info("decode attention stays on sdpa (LOADMASTER_DECODE_ATTENTION=sdpa)")
        return False
    if not kernel_build.status().available:
        return False
    config._attn_implementation = NATIVE_ATTENTION
    log.info("decode steps' attention runs on the native CPU kernel")
    return True
