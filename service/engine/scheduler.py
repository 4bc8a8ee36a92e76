"""The scheduler: which requests hold a slot of the KV pool, and which rows the next forward runs.

It owns the queue of waiting sequences, the running ones and what each slot of the
:class:`~service.engine.kv_pool.SlotKVCache` holds (:class:`~service.engine.prefix_index.SlotContents`), and
decides, once per engine iteration:

1. admission: waiting requests move into free slots, first come first served, while the KV budget (tokens: prompt
   + max new tokens of every admitted sequence) has room and the storage, laid out as slots × the longest of them,
   stays within it; a free slot that still holds the prompt's prefix is preferred
   (:mod:`service.engine.prefix_index`);
2. the iteration's rows: a decode row for every running sequence (one token, at its own position) and up to
   the step's prefill budget of prompt tokens in all, oldest sequence first. The budget
   (:mod:`service.engine.prefill_budget`) is :data:`PREFILL_CHUNK` for a wave of prompts, so a burst is prefilled
   together, and what fits the streams' inter-token latency when few prompts wait beside many streams, so a long
   prompt is prefilled over several iterations while the running streams keep decoding;
3. release: the slots of sequences that ended go back to the pool, their tokens kept as a cached prefix.

Its answer is a :class:`SchedulerOutput`, a typed record of what to run; the
:class:`~service.engine.step_executor.StepExecutor` runs it (the split of vLLM v1's scheduler and executor). The
scheduler never runs the model: the one device operation it starts is copying a cached prefix between slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from planner.types import PREFILL_CHUNK  # the plan budgets activations for exactly this step
from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import Row
from service.engine.prefill_budget import PrefillBudget
from service.engine.prefix_index import SlotContents, common_prefix
from service.engine.requests import Sequence
from service.engine.speculation.verification import Speculator
from service.errors import GenerationError, OverloadedError

#: Shortest shared prefix worth holding a prompt back an iteration for (a whole identical prompt always is).
SHARED_PREFIX_MIN = 16


@dataclass
class ScheduledRow:
    """One row of an iteration's forward: a decode row (the sequence's last token) or a prompt chunk."""

    seq: Sequence
    row: Row
    prefill: bool  # the row feeds prompt tokens (its sequence has chosen no token yet)
    #: A decode row's drafted tokens, fed after its last token for the target to verify (speculative decoding).
    drafts: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    """What one forward runs: decode rows first (``decodes`` of them), then prompt chunks.

    ``prefill_budget`` is what is left of the iteration's prefill budget after these chunks, and
    ``deferred`` says a prompt was held back for an earlier one's shared prefix: then, once this forward has
    computed that prefix, :meth:`Scheduler.schedule_prefill` gives the held prompts a round of their own.
    """

    rows: list[ScheduledRow]
    decodes: int
    prefill_budget: int
    deferred: bool


class Scheduler:
    """Admission, the KV pool's slots and the rows of each forward. Engine thread only, except :meth:`add` and
    :meth:`take_waiting` (under the engine's lock)."""

    def __init__(
        self,
        cache: SlotKVCache,
        *,
        slots: int,
        max_queue: int,
        max_total_tokens: int,
        kv_budget_tokens: int,
        prefix_cache: bool = True,
        prefill_chunk: int = PREFILL_CHUNK,
        speculator: Speculator | None = None,
    ):
        self.cache = cache
        self.speculator = speculator or Speculator()
        self.prefill_chunk = prefill_chunk  # the plan's step: it budgets activations for no wider a forward
        self.contents = SlotContents(slots)
        self.max_queue = max_queue
        self.max_total_tokens = max_total_tokens
        self.kv_budget_tokens = kv_budget_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        self.prefilled_tokens = 0  # prompt tokens run through the model (a reused prefix is not counted)
        self.reused_tokens = 0  # prompt tokens whose KV came from the prefix cache instead
        self.budget = PrefillBudget()

    # -- the queue (caller's thread, under the engine's lock) ------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Refuse a request no slot or KV budget could ever hold (it would wait forever)."""
        if seq.reserved - 1 > self.max_total_tokens or seq.reserved > self.kv_budget_tokens:
            raise GenerationError(
                f"The request needs {seq.reserved} tokens of KV cache (prompt + max_new_tokens); the server holds "
                f"{min(self.max_total_tokens, self.kv_budget_tokens)} per sequence. Shorten the prompt or lower "
                "max_new_tokens."
            )

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise OverloadedError(f"The queue is full ({self.max_queue} waiting); retry shortly.")
        self.waiting.append(seq)

    def take_waiting(self) -> list[Sequence]:
        """Empty the queue (the engine is stopping): its sequences, first come first."""
        waiting, self.waiting = list(self.waiting), deque()
        return waiting

    @property
    def active(self) -> int:
        """Sequences admitted and not yet ended (one that just finished counts no more, though its slot is freed
        at the end of the engine's iteration)."""
        return sum(1 for s in self.running if not s.done)

    @property
    def prefill_tokens(self) -> int:
        """The prefill budget of the last step (the ceiling before the first)."""
        return self.budget.last or self.prefill_chunk

    @property
    def reserved_tokens(self) -> int:
        """KV budget tokens the admitted sequences hold."""
        return sum(s.reserved for s in self.running)

    # -- one iteration (engine thread) -----------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Move waiting requests into slots, first come first served, while a slot is free and the KV budget holds
        their tokens (caller holds the lock). A slot that still holds the prompt's prefix is preferred."""
        newcomers = []
        reserved = self.reserved_tokens
        while self.waiting and self.contents.free:
            seq = self.waiting[0]
            if seq.cancelled.is_set():
                self.waiting.popleft()
                continue
            if reserved + seq.reserved > self.kv_budget_tokens:
                break
            prompt = seq.request.prompt_ids
            usable = len(prompt) - 1 if self._may_reuse(seq) else 0
            if not self._storage_holds(seq, self.contents.choose(prompt, usable)[0]):
                if self.running:
                    break  # first come first served: it waits for the running sequences to end
                self.cache.reset()  # idle, but shaped for other sequences: start the storage again
                self.contents.forget()
                usable = 0
            self.waiting.popleft()
            seq.slot, seq.prefilled = self.contents.take(prompt, usable)
            self.reused_tokens += seq.prefilled
            self._admissions += 1
            seq.admitted_at = self._admissions
            reserved += seq.reserved
            self.running.append(seq)
            newcomers.append(seq)
        return newcomers

    def _storage_holds(self, seq: Sequence, slot: int) -> bool:
        """Whether the KV storage, grown to seat ``seq`` in ``slot`` beside the running sequences at their longest
        (prompt + max new tokens each), stays within the KV budget: slots × capacity, as the storage is laid out."""
        slots = max([s.slot for s in self.running] + [slot]) + 1
        length = min(max(s.reserved for s in [*self.running, seq]), self.max_total_tokens)
        return self.cache.storage_tokens(slots, length) <= self.kv_budget_tokens

    def schedule(self) -> SchedulerOutput:
        """The iteration's forward: a decode row (one token) for every running sequence that has chosen a token,
        in slot order, and up to the step's prefill budget (at most :data:`PREFILL_CHUNK`) of prompt tokens of the
        sequences still prefilling. Decode rows and prompt chunks share one forward, so offloaded layers are read
        once per iteration."""
        for seq in self.running:
            if seq.cancelled.is_set():
                seq.done = True
        decoders = sorted(
            (s for s in self.running if not s.done and not s.prefilling and s.generated), key=lambda s: s.slot
        )
        self.speculator.begin_step(len(decoders))
        drafts = self.speculator.drafts(decoders, [self._draft_room(s) for s in decoders])
        rows = [self._decode_row(s, d) for s, d in zip(decoders, drafts)]
        prompts = sum(1 for s in self.running if s.prefilling and not s.done)
        chunks = self.schedule_prefill(self.budget.tokens(self.prefill_chunk, decoders=len(rows), prompts=prompts))
        chunks.rows[:0] = rows
        chunks.decodes = len(rows)
        return chunks

    def _draft_room(self, seq: Sequence) -> int:
        """Drafts ``seq`` may feed this step: within the request's max new tokens (the target's own token comes
        after them) and the slot's length."""
        start = len(seq.request.prompt_ids) + len(seq.generated) - 1
        return min(seq.request.max_new_tokens - len(seq.generated) - 1, self.max_total_tokens - start - 1)

    def _decode_row(self, seq: Sequence, drafts: list[int]) -> ScheduledRow:
        """``seq``'s decode row: its last token at its own position, followed by the tokens it drafts, if any
        (:mod:`service.engine.speculation.verification`), which then asks for the logits after every fed token."""
        start = len(seq.request.prompt_ids) + len(seq.generated) - 1
        row = Row(seq.slot, start, [*seq.generated[-1:], *drafts], every_logits=bool(drafts), decoding=True)
        return ScheduledRow(seq, row, False, tuple(drafts))

    def trim(self, seq: Sequence) -> None:
        """After a verify pass: the slot holds the KV of the prompt and every generated token but the last; the
        rejected drafts' keys past that are left to be overwritten (no cache length to change, nothing copied)."""
        del self.contents.tokens[seq.slot][len(seq.request.prompt_ids) + len(seq.generated) - 1 :]

    def schedule_prefill(self, budget: int) -> SchedulerOutput:
        """The next prompt chunks, oldest sequence first, up to ``budget`` tokens in all (no decode rows: also the
        second round of an iteration, for prompts that waited on an earlier one's shared prefix)."""
        chunks: list[ScheduledRow] = []
        deferred = False
        for seq in sorted(self.running, key=lambda s: s.admitted_at):
            if budget <= 0:
                break
            if not seq.prefilling or seq.done or seq.cancelled.is_set():
                continue
            if self._waits_for_shared_prefix(seq):
                deferred = True
                continue
            self._reuse_prefix(seq)
            take = min(len(seq.request.prompt_ids) - seq.prefilled, budget)
            tokens = seq.request.prompt_ids[seq.prefilled : seq.prefilled + take]
            row = Row(seq.slot, seq.prefilled, tokens, every_logits=seq.request.prompt_logprobs)
            chunks.append(ScheduledRow(seq, row, True))
            budget -= take
        return SchedulerOutput(chunks, decodes=0, prefill_budget=budget, deferred=deferred)

    def record_forward(self, rows: list[ScheduledRow]) -> None:
        """A forward over ``rows`` succeeded: their tokens are now in their slots (and, for prompt chunks, their
        sequences are that much further through their prompts)."""
        for scheduled in rows:
            seq, tokens = scheduled.seq, scheduled.row.tokens
            self.contents.tokens[seq.slot].extend(tokens)
            if scheduled.prefill:
                seq.prefilled += len(tokens)
                self.prefilled_tokens += len(tokens)

    def release(self) -> None:
        """Free the slots of sequences that ended; what they hold stays as a cached prefix."""
        keep = []
        for seq in self.running:
            if seq.done or seq.cancelled.is_set():
                seq.done = True
                if seq.slot is not None:
                    self.contents.release(seq.slot)
            else:
                keep.append(seq)
        self.running = keep

    # -- prefix reuse ----------------------------------------------------------------------------------------------
    def _may_reuse(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt may take KV another sequence computed: not with the prefix cache off, nor for a
        prompt whose own logprobs were asked for (a reused token has no logits)."""
        return self.prefix_cache and not seq.request.prompt_logprobs

    def _waits_for_shared_prefix(self, seq: Sequence) -> bool:
        """Whether an earlier sequence still prefilling shares more of this prompt than any slot holds now: then
        this one waits and copies that prefix once computed (identical prompts admitted together prefill once).
        A prompt whose own logprobs were asked for never waits: it is prefilled whole."""
        if not self._may_reuse(seq):
            return False
        prompt = seq.request.prompt_ids
        usable = len(prompt) - 1
        held = max(seq.prefilled, self._best_source_tokens(seq))
        for other in self.running:
            if other is seq or other.done or other.admitted_at > seq.admitted_at or not other.prefilling:
                continue
            shared = min(common_prefix(prompt, other.request.prompt_ids), usable)
            if shared > held and shared >= min(SHARED_PREFIX_MIN, usable):
                return True
        return False

    def _best_source_tokens(self, seq: Sequence) -> int:
        prompt = seq.request.prompt_ids
        hit = self.contents.best_source(prompt, len(prompt) - 1, exclude=seq.slot)
        return hit.tokens if hit is not None else 0

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Copy the longest prefix of the prompt another slot holds into this sequence's slot, if it is longer
        than what the slot holds already (not for a prompt whose own logprobs were asked for, nor with the prefix
        cache off)."""
        if not self._may_reuse(seq):
            return
        prompt = seq.request.prompt_ids
        hit = self.contents.best_source(prompt, len(prompt) - 1, exclude=seq.slot)
        if hit is None or hit.tokens <= seq.prefilled:
            return
        self.cache.copy_prefix(hit.slot, seq.slot, seq.prefilled, hit.tokens)
        self.contents.tokens[seq.slot][seq.prefilled :] = prompt[seq.prefilled : hit.tokens]
        self.reused_tokens += hit.tokens - seq.prefilled
        seq.prefilled = hit.tokens
