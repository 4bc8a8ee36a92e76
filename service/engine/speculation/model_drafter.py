"""Drafts from a cheap copy of the target: its own weights quantized to int4 or int8 (``--speculate int4|int8``).

A model read from disk pays its weight reads once per forward whatever the row width, so a pass that verifies ``k``
drafts costs about what a pass that decodes one token costs. Prompt lookup (:mod:`.ngram_drafter`) only drafts
text that repeats; a quantized copy of the target agrees with it on most tokens of any text, because it *is* the
target up to rounding, and being resident and 4-8x smaller it proposes ``k`` tokens for a fraction of one target
pass. The copy is loaded once (:mod:`service.model.draft_copy`); this module only runs it.

Each drafting sequence keeps its own transformers :class:`~transformers.DynamicCache` over the tokens it has fed
the copy. On a sequence's first draft its whole context (the prompt, in chunks) is prefilled into that cache; after
that a draft feeds only what the cache does not hold yet: the tokens the target accepted and emitted since. Drafts
the target rejected are cropped off first, so no step re-reads the whole context. The crop is lazy (at the next
draft, by the longest common prefix of what the cache holds and the sequence's tokens): a row that rests from
drafting costs the copy nothing, and catches up in one forward when it drafts again.

Rows draft one at a time, each its own forward per draft token: the use this is for is one stream whose target
streams from disk, where a single row is the whole batch. Batching the drafting rows into one forward of the copy
is left for later; with many rows the :class:`~.verification.StepGate` (which counts drafting time) shuts drafting
where it costs more than it saves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Most context tokens one prefill forward of the copy feeds (bounds its activations on a long prompt).
PREFILL_CHUNK = 512


class RowDraft:
    """One sequence's drafting state: the copy's KV cache for it and the tokens that cache holds, in order."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = self._new_cache()
        self.held: list[int] = []
        #: Leading tokens of ``held`` that are the sequence's own (not drafts): a sequence only grows, so these
        #: need no comparison at the next draft (which then costs O(new tokens), not O(context)).
        self.own = 0

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The copy's ``k`` greedy tokens after ``tokens`` (the sequence's prompt and output so far); empty for
        ``k <= 0``, which runs nothing (the cache catches up at the next draft)."""
        if k <= 0 or not tokens:
            return []
        keep = self.own + _common_prefix(self.held[self.own :], tokens[self.own :])
        keep = min(keep, len(tokens) - 1)  # the last token is always fed: its logits give the first draft
        self._crop(keep)
        drafts: list[int] = []
        with torch.inference_mode():
            logits = self._feed(list(tokens[len(self.held) :]))
            for i in range(k):
                drafts.append(int(logits.argmax()))
                if i + 1 < k:
                    logits = self._feed(drafts[-1:])
        self.own = len(tokens)
        return drafts

    def _crop(self, keep: int) -> None:
        """Drop what the cache holds past its first ``keep`` tokens (rejected drafts, or anything the sequence no
        longer has); a cache that cannot be cut back exactly (a sliding-window layer) is started afresh."""
        drop = len(self.held) - keep
        if drop <= 0:
            return
        self.cache.crop(-drop)
        if self.cache.get_seq_length() == keep:
            del self.held[keep:]
            self.own = min(self.own, keep)
        else:
            self.cache = self._new_cache()
            self.held = []
            self.own = 0

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` through the copy after what the cache holds (chunked); the logits after the last one."""
        device = self.model.get_input_embeddings().weight.device
        logits = None
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            out = self.model(
                input_ids=torch.tensor([chunk], device=device), cache=self.cache, use_cache=True, logits_to_keep=1
            )
            self.held.extend(chunk)
            logits = out.logits[0, -1]
        if logits is None:
            raise ValueError("the draft copy was fed no tokens")
        return logits


class ModelDrafter:
    """Makes each drafting sequence's :class:`RowDraft` over the one shared draft model (a causal LM with the
    target's vocabulary, which transformers runs with a ``DynamicCache``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def row(self) -> RowDraft:
        return RowDraft(self.model)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
