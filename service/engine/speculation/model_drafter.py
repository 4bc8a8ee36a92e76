"""Drafts from a cheap copy of the target: its own weights quantized to int4 or int8 (``--speculate int4|int8``), or
from a smaller checkpoint with its tokenizer (``--draft-model``, :mod:`service.model.draft_model`): any causal LM
with the target's vocabulary runs here the same way.

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

A step's drafting rows draft together (:meth:`ModelDrafter.propose`): one forward of the copy for every row's new
context, then one per draft position, each over the rows that still want a draft there (batched one-token rows:
the native decode step again). The :class:`~.verification.StepGate` counts this time in a drafting step's cost and
shuts drafting where it costs more than it saves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from planner.placement.draft_budget import DRAFT_PREFILL_CHUNK
from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import SHORT_ROW, ModelRunner, Row
from service.engine.prefix_index import common_prefix

#: Most tokens one forward of the copy feeds, all rows together (bounds its activations on long prompts; the
#: target's plan reserves the draft's working memory for this many).
PREFILL_CHUNK = DRAFT_PREFILL_CHUNK
#: New tokens beyond which a draft prefills them in a forward of their own, timed apart (a verify pass emits at most
#: ``k + 1``; more means the row rested or starts). Fewer run on the native decode step where the copy takes it.
CATCH_UP = SHORT_ROW


@dataclass(frozen=True)
class DraftAsk:
    """One row's request for drafts this step: its state, its tokens so far (prompt and output) and how many."""

    row: RowDraft
    tokens: Sequence[int]
    k: int


@dataclass(frozen=True)
class DraftBatch:
    """A step's drafts, one list per :class:`DraftAsk` in order, and the seconds spent catching rows up on context
    (first drafts, or the first after a rest): a one-off the step gate does not count as the step's drafting cost."""

    drafts: list[list[int]]
    prefill_seconds: float


class ModelDrafter:
    """The copy (a causal LM with the target's vocabulary, on the CPU), its slot cache (``slots`` slots of up to
    ``max_len`` tokens: the engine's) and its runner; makes each drafting sequence's :class:`RowDraft`, and drafts
    for a step's rows together (:meth:`propose`)."""

    def __init__(self, model: torch.nn.Module, slots: int, max_len: int):
        self.model = model
        self.cache = SlotKVCache(slots, max_len)
        self.runner = ModelRunner(model, model.get_input_embeddings().weight.device, self.cache)

    def row(self, slot: int) -> RowDraft:
        """The drafting state of the sequence that holds engine slot ``slot`` (its slot in the copy's cache too)."""
        if not 0 <= slot < self.cache.slots:
            raise ValueError(f"slot {slot} is outside the draft cache's {self.cache.slots} slots")
        return RowDraft(self, slot)

    def propose(self, asks: Sequence[DraftAsk]) -> DraftBatch:
        """Each ask's ``k`` greedy tokens of the copy, the rows batched: one forward for every row's new context
        (long catch-ups in a forward of their own, timed apart), then one per draft position for the rows that
        want that many. An ask with ``k <= 0`` runs nothing (its slot catches up at its next draft)."""
        drafts: list[list[int]] = [[] for _ in asks]
        live = [i for i, ask in enumerate(asks) if ask.k > 0 and ask.tokens]
        feeds = {i: asks[i].row.cut_back(asks[i].tokens) for i in live}
        behind = [i for i in live if len(feeds[i]) > CATCH_UP]
        prefill = 0.0
        if behind:  # a first draft or one after a rest: prefill the context apart
            started = time.perf_counter()
            self._feed(asks, {i: feeds[i][:-1] for i in behind})
            prefill = time.perf_counter() - started
            feeds.update({i: feeds[i][-1:] for i in behind})
        while live:
            logits = self._feed(asks, {i: feeds[i] for i in live})
            for i in live:
                drafts[i].append(int(logits[i].argmax()))
            live = [i for i in live if len(drafts[i]) < asks[i].k]
            feeds = {i: drafts[i][-1:] for i in live}
        for ask in asks:
            if ask.k > 0 and ask.tokens:
                ask.row.own = len(ask.tokens)
        return DraftBatch(drafts, prefill)

    def _feed(self, asks: Sequence[DraftAsk], feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Write each ask's ``feeds`` tokens into its slot after what the slot holds, at most :data:`PREFILL_CHUNK`
        tokens a forward in all (every row gets at least one); the logits after each row's last token."""
        out: dict[int, torch.Tensor] = {}
        pending = {i: list(tokens) for i, tokens in feeds.items() if tokens}
        while pending:
            budget = PREFILL_CHUNK
            rows, taken = [], []
            for n, (i, tokens) in enumerate(pending.items()):
                after = len(pending) - n - 1  # rows after this one: each keeps at least one token of the budget
                take = max(1, min(len(tokens), budget - after))
                budget -= take
                taken.append((i, tokens[:take]))
                rows.append(Row(asks[i].row.slot, len(asks[i].row.held), tokens[:take], decoding=True))
            last = self.runner.run(rows).last
            for b, (i, chunk) in enumerate(taken):
                asks[i].row.held.extend(chunk)
                out[i] = last[b]
                pending[i] = pending[i][len(chunk) :]
            pending = {i: tokens for i, tokens in pending.items() if tokens}
        return out


class RowDraft:
    """One sequence's drafting state: its slot of the copy's cache and the tokens that slot holds, in order."""

    def __init__(self, drafter: ModelDrafter, slot: int):
        self.drafter = drafter
        self.slot = slot
        self.held: list[int] = []
        #: Leading tokens of ``held`` that are the sequence's own (not drafts): a sequence only grows, so these
        #: need no comparison at the next draft (which then costs O(new tokens), not O(context)).
        self.own = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """This row's ``k`` drafts after ``tokens``, alone (:meth:`ModelDrafter.propose` drafts a step's rows
        together)."""
        return self.drafter.propose([DraftAsk(self, tokens, k)]).drafts[0]

    def cut_back(self, tokens: Sequence[int]) -> list[int]:
        """Forget what the slot holds past its longest common prefix with ``tokens`` (rejected drafts: the next
        tokens overwrite them, the mask hides them until then) and return the tokens still to feed (at least the
        last: its logits give the first draft)."""
        keep = self.own + common_prefix(self.held[self.own :], tokens[self.own :])
        keep = min(keep, len(tokens) - 1)
        del self.held[keep:]
        self.own = min(self.own, keep)
        return list(tokens[keep:])
