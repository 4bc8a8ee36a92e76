"""Which prompt chunks share a prefill forward: one forward over several pays a forward's fixed cost once, but
every padding token is work thrown away."""

from __future__ import annotations

from collections.abc import Sequence

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
