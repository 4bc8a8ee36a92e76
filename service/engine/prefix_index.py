"""What each slot of the KV cache holds, token by token, so that a prompt can reuse KV another request computed.

A slot's tokens are those whose keys and values are in the cache: a running sequence's prompt (as far as it is
prefilled) and generated tokens, or, once that sequence has ended and the slot is free, whatever it left behind.
A free slot keeps its contents until it is handed to another sequence, which makes the free slots a prefix cache
at no memory cost: a new request that starts like one of them takes that slot and skips those tokens' prefill.
A prompt that shares a prefix with a running sequence's slot has that prefix copied into its own slot instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class PrefixHit:
    """Where a prompt's reusable prefix is: ``slot`` holds its first ``tokens`` tokens."""

    slot: int
    tokens: int


class SlotContents:
    """The token ids held by each slot, and which slots are free (lowest handed out first, unless one holds the
    prompt's prefix)."""

    def __init__(self, slots: int):
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        self.free: set[int] = set(range(slots))

    def choose(self, prompt: Sequence[int], usable: int) -> tuple[int, int]:
        """The free slot :meth:`take` would give ``prompt``, and how many of its tokens that slot already holds (at
        most ``usable``): the free slot with the longest common prefix; with none, the lowest slot."""
        if not self.free:
            raise RuntimeError("no free KV cache slot; admission should have waited")
        best, reused = min(self.free), 0
        for slot in sorted(self.free):
            n = min(common_prefix(prompt, self.tokens[slot]), usable)
            if n > reused:
                best, reused = slot, n
        return best, reused

    def take(self, prompt: Sequence[int], usable: int) -> tuple[int, int]:
        """Take the slot :meth:`choose` names; returns it and the prompt tokens it already holds."""
        best, reused = self.choose(prompt, usable)
        self.free.discard(best)
        del self.tokens[best][reused:]
        return best, reused

    def forget(self) -> None:
        """Every slot's tokens are gone (the storage was dropped): no slot holds a prefix any more."""
        for held in self.tokens:
            held.clear()

    def release(self, slot: int) -> None:
        """Free ``slot``; its tokens stay as a cached prefix until the slot is taken again."""
        self.free.add(slot)

    def best_source(self, prompt: Sequence[int], usable: int, exclude: int) -> PrefixHit | None:
        """The slot (other than ``exclude``) holding the longest prefix of ``prompt``, capped at ``usable``."""
        hit: PrefixHit | None = None
        for slot, held in enumerate(self.tokens):
            if slot == exclude:
                continue
            n = min(common_prefix(prompt, held), usable)
            if n > 0 and (hit is None or n > hit.tokens):
                hit = PrefixHit(slot, n)
        return hit
