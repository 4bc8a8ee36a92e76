"""Drafts from a cheap copy of the target: its own weights quantized to int4 or int8 (``--speculate int4|int8``).

A model read from disk pays its weight reads once per forward whatever the row width, so a pass that verifies ``k``
drafts costs about what a pass that decodes one token costs. Prompt lookup (:mod:`.ngram_drafter`) only drafts
text that repeats; a quantized copy of the target agrees with it on most tokens of any text, because it *is* the
target up to rounding, and being resident and 4-8x smaller it proposes ``k`` tokens for a fraction of one target
pass. The copy is loaded once (:mod:`service.model.draft_copy`); this module only runs it.

It runs on the engine's own machinery: a :class:`~service.engine.model_runner.ModelRunner` over a
:class:`~service.engine.kv_pool.SlotKVCache` of the copy's own, one slot per engine slot, so a one-token draft step
takes the native decode step (:mod:`loaders.native.decode_step`) where the model allows, as the target's plain
step does. Each drafting sequence remembers the tokens its slot of the copy's cache holds. On its first draft its
whole context (the prompt, in chunks) is prefilled there; after that a draft feeds only what the slot does not hold
yet: the tokens the target accepted and emitted since. Drafts the target rejected are cut back for free, as in the
target's pool: the slot holds no length, the next tokens are written from the kept length on and the mask hides
the rest. The cut is lazy (at the next draft, by the longest common prefix of what the slot holds and the
sequence's tokens), so a row that rests from drafting costs the copy nothing, and catches up in one forward when it
drafts again. The cache grows with the longest sequence drafted, as the target's does.

Rows draft one at a time, each with a forward per draft token: the use this is for is one stream whose target
streams from disk, where a single row is the whole batch. Batching the drafting rows into one forward of the copy
is left for later; with many rows the :class:`~.verification.StepGate` (which counts drafting time) shuts drafting
where it costs more than it saves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import ModelRunner, Row

#: Most context tokens one prefill forward of the copy feeds (bounds its activations on a long prompt).
PREFILL_CHUNK = 512
#: New tokens beyond which a draft prefills them in a forward of their own, timed apart (a verify pass emits at most
#: ``k + 1``; more means the row rested or starts).
CATCH_UP = 17


class ModelDrafter:
    """The copy (a causal LM with the target's vocabulary, on the CPU), its slot cache (``slots`` slots of up to
    ``max_len`` tokens: the engine's) and its runner; makes each drafting sequence's :class:`RowDraft`."""

    def __init__(self, model: torch.nn.Module, slots: int, max_len: int):
        self.model = model
        self.cache = SlotKVCache(slots, max_len)
        self.runner = ModelRunner(model, model.get_input_embeddings().weight.device, self.cache)

    def row(self, slot: int) -> RowDraft:
        """The drafting state of the sequence that holds engine slot ``slot`` (its slot in the copy's cache too)."""
        if not 0 <= slot < self.cache.slots:
            raise ValueError(f"slot {slot} is outside the draft cache's {self.cache.slots} slots")
        return RowDraft(self.runner, slot)


class RowDraft:
    """One sequence's drafting state: its slot of the copy's cache and the tokens that slot holds, in order."""

    def __init__(self, runner: ModelRunner, slot: int):
        self.runner = runner
        self.slot = slot
        self.held: list[int] = []
        #: Leading tokens of ``held`` that are the sequence's own (not drafts): a sequence only grows, so these
        #: need no comparison at the next draft (which then costs O(new tokens), not O(context)).
        self.own = 0
        #: Seconds the last :meth:`propose` spent prefilling context the slot did not hold (its first draft, or one
        #: after a rest): a one-off, which the step gate leaves out of what drafting costs per step.
        self.prefill_seconds = 0.0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The copy's ``k`` greedy tokens after ``tokens`` (the sequence's prompt and output so far); empty for
        ``k <= 0``, which runs nothing (the slot catches up at the next draft)."""
        if k <= 0 or not tokens:
            return []
        keep = self.own + _common_prefix(self.held[self.own :], tokens[self.own :])
        keep = min(keep, len(tokens) - 1)  # the last token is always fed: its logits give the first draft
        del self.held[keep:]  # the rest of the slot is overwritten from here on, and masked until then
        self.own = min(self.own, keep)
        self.prefill_seconds = 0.0
        if len(tokens) - keep > CATCH_UP:  # a first draft or one after a rest: prefill the context apart
            started = time.perf_counter()
            self._feed(list(tokens[keep:-1]))
            self.prefill_seconds = time.perf_counter() - started
            keep = len(tokens) - 1
        drafts: list[int] = []
        logits = self._feed(list(tokens[keep:]))
        for i in range(k):
            drafts.append(int(logits.argmax()))
            if i + 1 < k:
                logits = self._feed(drafts[-1:])
        self.own = len(tokens)
        return drafts

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Write ``tokens`` into the slot after what it holds (in chunks); the logits after the last one."""
        logits = None
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            logits = self.runner.run([Row(self.slot, len(self.held), chunk)]).last[0]
            self.held.extend(chunk)
        if logits is None:
            raise ValueError("the draft copy was fed no tokens")
        return logits


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
