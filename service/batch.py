"""The running batch: active sequences whose KV caches are stacked left-padded, decoded one token per step.

A sequence is prefilled alone (batch of one, no padding), then its cache is merged into the batch between decode
steps; a finished or cancelled sequence is removed by selecting the other rows. Left padding is masked out by the
attention mask, and each row's position ids count only its real tokens, so a row computes what it would alone.
Leading columns that every row pads are trimmed away, so a long-gone sequence leaves no padding behind.

Only plain full-attention caches (``DynamicLayer``) can be stacked like this; for any other cache (sliding window,
linear attention, quantized) each sequence keeps a batch of its own (see :func:`stackable`).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def stackable(cache: Any) -> bool:
    """Whether caches like this one can be stacked along the batch dimension by :class:`DecodeBatch`."""
    layers = getattr(cache, "layers", None)
    return isinstance(cache, DynamicCache) and bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(t: torch.Tensor, new_len: int) -> torch.Tensor:
    """Pad dim -2 (sequence) of a ``[B, H, L, D]`` tensor on the left with zeros up to ``new_len``."""
    missing = new_len - t.shape[-2]
    if missing <= 0:
        return t
    pad = t.new_zeros(t.shape[:-2] + (missing, t.shape[-1]))
    return torch.cat([pad, t], dim=-2)


class DecodeBatch:
    """Sequences decoded together. Rows are in the order of ``self.items`` (opaque per-row objects)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.items: list[Any] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = real token, 0 = padding
        self.positions: torch.Tensor | None = None  # [B] position id of each row's next token

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Any, cache: DynamicCache, length: int) -> None:
        """Append one prefilled sequence (a batch-of-one cache holding ``length`` tokens)."""
        mask = torch.ones((1, length), dtype=torch.long, device=self.device)
        pos = torch.tensor([length], dtype=torch.long, device=self.device)
        if self.cache is None or not self.items:
            self.cache, self.mask, self.positions, self.items = cache, mask, pos, [item]
            return
        cur = self.mask.shape[1]
        new_len = max(cur, length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, new_len), _pad_left(theirs.keys, new_len)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, new_len), _pad_left(theirs.values, new_len)], dim=0)
        self.mask = torch.cat(
            [
                torch.nn.functional.pad(self.mask, (new_len - cur, 0)),
                torch.nn.functional.pad(mask, (new_len - length, 0)),
            ],
            dim=0,
        )
        self.positions = torch.cat([self.positions, pos])
        self.items.append(item)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into ``items``), dropping the others' caches, then trim shared padding."""
        if len(rows) == len(self.items):
            return
        if not rows:
            self.items, self.cache, self.mask, self.positions = [], None, None, None
            return
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx.to(layer.keys.device))
            layer.values = layer.values.index_select(0, idx.to(layer.values.device))
        self.mask = self.mask.index_select(0, idx)
        self.positions = self.positions.index_select(0, idx)
        self.items = [self.items[i] for i in rows]
        self._trim()

    def _trim(self) -> None:
        real = self.mask.any(dim=0)
        first = int(torch.nonzero(real)[0].item()) if bool(real.any()) else 0
        if first == 0:
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys[..., first:, :]
            layer.values = layer.values[..., first:, :]
        self.mask = self.mask[:, first:]

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row; return the next-token logits, ``[B, vocab]``."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device).unsqueeze(1)
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=self.positions.unsqueeze(1),
            cache=self.cache,
            use_cache=True,
        )
        self.positions = self.positions + 1
        return out.logits[:, -1, :]


@torch.inference_mode()
def prefill(model: torch.nn.Module, device: torch.device, prompt: Sequence[int]) -> tuple[torch.Tensor, DynamicCache]:
    """Run a prompt alone; return its last position's logits ``[vocab]`` and its batch-of-one cache."""
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=model.config), use_cache=True)
    return out.logits[0, -1, :], out.cache
