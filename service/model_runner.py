"""One forward over rows of the slot cache: each row feeds some tokens of one sequence at that sequence's own
positions, and gets back the logits of its last fed token.

A decode step is rows of one token each; a prefill chunk is rows of up to a chunk's tokens (right-padded to the
longest). The runner builds the position ids and the attention mask itself (row ``b``'s token ``t`` sees keys
``0 .. start_b + t`` of its own slot, and, for a sliding-window model, only the window's), hands transformers a
prepared 4D mask (which it uses as given) and the :class:`~service.kv_cache.SlotKVCache`, and asks for the logits of
each row's last real token only. The model is called as it is loaded, so device-map hooks, disk offload and the
native kernels all run as for any forward, once per call for every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.kv_cache import SlotKVCache


@dataclass
class Row:
    """The tokens one sequence feeds in a forward, written into ``slot`` from position ``start``."""

    slot: int
    start: int
    tokens: Sequence[int]


class ModelRunner:
    """Runs the model over :class:`Row`\\ s with the engine's slot cache."""

    def __init__(self, model: torch.nn.Module, device: torch.device, cache: SlotKVCache):
        self.model = model
        self.device = device
        self.cache = cache
        config = getattr(model, "config", None)
        implementation = getattr(config, "_attn_implementation", None) or "eager"
        self.bool_mask = implementation == "sdpa"
        self.window = getattr(config, "sliding_window", None) if _uses_sliding_window(config) else None
        layer_types = set(getattr(config, "layer_types", None) or ())
        self.mixed = self.window is not None and layer_types == {"full_attention", "sliding_attention"}
        self.mask_dtype = getattr(model, "dtype", torch.float32)

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """Feed every row's tokens; return the logits after each row's last token, ``[B, vocab]``."""
        width = max(len(r.tokens) for r in rows)
        lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r.tokens)] = torch.tensor(list(r.tokens), dtype=torch.long)
        offsets = torch.arange(width).unsqueeze(0)
        # padding positions repeat the row's last real one: never past the model's position table
        positions = starts.unsqueeze(1) + torch.minimum(offsets, (lengths - 1).unsqueeze(1))
        span = int((starts + lengths).max())
        keys = torch.arange(span).view(1, 1, span)
        query = (starts.unsqueeze(1) + offsets).unsqueeze(2)  # [B, T, 1]
        causal = keys <= query
        windowed = causal & (keys > query - self.window) if self.window is not None else causal
        mask: torch.Tensor | dict[str, torch.Tensor]
        if self.mixed:  # per-layer-type masks, as transformers passes them to hybrid models
            mask = {"full_attention": self._prepared(causal), "sliding_attention": self._prepared(windowed)}
        else:
            mask = self._prepared(windowed)
        if width == 1:
            keep: int | torch.Tensor = 1
            pick = None
        else:
            last = lengths - 1
            keep_positions = torch.unique(last)
            keep = keep_positions.to(self.device)
            pick = torch.searchsorted(keep_positions, last)
        self.cache.bind([r.slot for r in rows], [r.start for r in rows], width, span)
        try:
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask,
                position_ids=positions.to(self.device),
                cache=self.cache,
                use_cache=True,
                logits_to_keep=keep,
            )
        finally:
            self.cache.unbind()
        logits = out.logits
        if pick is None:
            return logits[:, -1, :]
        return logits[torch.arange(len(rows), device=logits.device), pick.to(logits.device)]

    def _prepared(self, allowed: torch.Tensor) -> torch.Tensor:
        """``[B, T, span]`` booleans as the 4D mask the attention implementation takes (bool for SDPA, additive
        otherwise), on the input device."""
        mask = allowed.unsqueeze(1)
        if not self.bool_mask:
            mask = torch.zeros(mask.shape, dtype=self.mask_dtype).masked_fill_(~mask, torch.finfo(self.mask_dtype).min)
        return mask.to(self.device)


def _uses_sliding_window(config) -> bool:
    """Whether the model's attention is windowed (Mistral-style ``sliding_window``, unless switched off)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return False
    return getattr(config, "use_sliding_window", True) is not False


def supports_slot_cache(model: torch.nn.Module) -> bool:
    """Whether the model can run on the slot cache: a causal LM whose attention layers all take a transformers
    ``Cache`` through ``update`` and accept a prepared 4D mask (plain full or sliding-window attention)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return False
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    return implementation in ("sdpa", "eager")
