"""The running batch: active sequences whose KV caches are stacked left-padded, decoded one token per step.

Prompts that arrive together are prefilled together, left-padded to the longest (see :func:`prefill_groups` for
which ones share a forward), then their cache is merged into the batch between decode steps; a finished or cancelled
sequence is removed by selecting the other rows. Left padding is masked out by the
attention mask, and each row's position ids count only its real tokens, so a row computes what it would alone.
Leading columns that every row pads are trimmed away, so a long-gone sequence leaves no padding behind.

Only plain full-attention caches (``DynamicLayer``) can be stacked like this; for any other cache (sliding window,
linear attention, quantized) each sequence keeps a batch of its own (see :func:`stackable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

    def add(self, items: Sequence[Any], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append prefilled sequences: ``cache`` holds one left-padded row per item, ``mask`` (``[k, L]``) marks
        their real tokens (as :func:`prefill` returns them)."""
        mask = mask.to(device=self.device, dtype=torch.long)
        length = mask.shape[1]
        pos = mask.sum(dim=1)
        if self.cache is None or not self.items:
            self.cache, self.mask, self.positions, self.items = cache, mask, pos, list(items)
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
        self.items.extend(items)

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


#: Most tokens, padding included, that one batched prefill may run (bounds its activation memory).
PREFILL_TOKENS = 256
#: Largest share of a batched prefill that may be padding; a prompt that would exceed it starts another prefill.
PREFILL_PADDING = 0.25


def prefill_groups(
    lengths: Sequence[int], max_tokens: int = PREFILL_TOKENS, max_padding: float = PREFILL_PADDING
) -> list[list[int]]:
    """Split prompts (given by their lengths) into batches to prefill together; returns indices into ``lengths``.

    One forward over several prompts pays a forward's fixed cost once (reading every weight, the per-layer Python;
    about one batch-of-one decode step) instead of once per prompt, but every padding token is work thrown away:
    on CPU a padded token costs as much as a real one. So prompts are taken shortest first and a batch grows while
    it stays within ``max_tokens`` (padding included) and ``max_padding``.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        padded = lengths[i] * (len(current) + 1)  # the newest prompt is the longest
        if current and (padded > max_tokens or padded - (real + lengths[i]) > max_padding * padded):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        groups.append(current)
    return groups


@torch.inference_mode()
def prefill(
    model: torch.nn.Module, device: torch.device, prompts: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
    """Run prompts in one forward, left-padded to the longest.

    Returns each prompt's last-position logits ``[k, vocab]``, the cache (one row per prompt) and the attention
    mask ``[k, L]`` (1 = real token). Padding is masked out and position ids count only real tokens, so each row
    computes what it would alone; a single prompt has no padding at all.
    """
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    extra = {"logits_to_keep": 1} if _keeps_last_logits(model) else {}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        cache=DynamicCache(config=model.config),
        use_cache=True,
        **extra,
    )
    return out.logits[:, -1, :], out.cache, mask


def _keeps_last_logits(model: torch.nn.Module) -> bool:
    """Whether the model can compute logits for the last position only (no ``[k, L, vocab]`` tensor in prefill)."""
    supports = getattr(model, "_supports_logits_to_keep", None)
    try:
        return bool(supports()) if callable(supports) else False
    except Exception:  # noqa: BLE001 - an odd forward signature: compute all logits, as plain transformers would
        return False
