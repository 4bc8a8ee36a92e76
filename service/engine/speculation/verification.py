"""Speculative decoding inside continuous batching: which rows draft, how many tokens, and what a verify pass keeps.

A decode row normally feeds its last token and gets one new token per forward. A row that speculates feeds its last
token followed by ``d`` drafted tokens (prompt lookup, :mod:`.ngram_drafter`, or the target's own weights quantized,
:mod:`.model_drafter`) and asks for the logits after each of them, in the same forward as every other row: one pass
of the target (one read of its offloaded layers) checks all ``d`` drafts. Its greedy choice after each fed token is
what decoding without speculation would have chosen there, as long as every draft before it was right; so the row
keeps the longest prefix of drafts that equals the target's choices, plus the target's own token after that prefix
(:func:`accepted`): 1 to ``d + 1`` tokens a pass, identical to plain greedy decoding.

A rejected tail costs nothing to roll back. The KV pool holds no length per slot: a row's length is where its next
row starts (prompt + generated - 1), and the mask hides everything beyond. The rejected drafts' keys stay in the
slot past that length and are overwritten by the next tokens; only the scheduler's record of what the slot holds
is cut back (:meth:`~service.engine.scheduler.Scheduler.trim`).

A sampled row keeps its distribution by the standard accept/resample rule (:func:`sampled`): a prompt lookup draft is
a point mass, and so is the quantized copy's (it drafts greedily), so draft ``x`` is accepted with the target's
probability of ``x`` and, on rejection, the token is drawn from the target with ``x`` removed. Its random numbers all
come from its own seeded generator, so a seed gives the same tokens on every run (not the same tokens as without
speculation, which draws differently: the same distribution).

Which rows speculate: greedy and sampled rows with no grammar, no penalties and no alternatives asked for. A grammar
or penalty row would need its chooser's state advanced per draft, and a logprobs row alternatives per position;
they decode one token a step, as without speculation, so their output never changes.

Each row's draft length adapts to its acceptance (:class:`DraftLength`): it grows after a pass that accepted every
draft and halves after one that accepted none, and at zero the row stops drafting for a while and then probes with
one token. So a model or a text where drafts fail pays for few wasted positions.

The row is verified on its logits as the forward returns them, so it meets the same numbers as plain decoding only
as far as the runner gives a row the same logits whatever it is batched with: exactly in fp32 (to ~1e-6, tested
token for token). Where the native decode step runs the model, a verify row runs on it too, one step-row a token
(:meth:`~service.engine.model_runner.ModelRunner.run`), so in bf16 each token gets the bits plain decoding gives it;
a step too wide for it (more than 32 tokens in all) runs the forward's prompt kernels, and a bf16 near tie may then
fall the other way.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import Literal

import torch

from planner.placement.speculative_rate import RESIDENT_DRAFT_TOKENS
from service.engine.requests import Sequence
from service.engine.sampling import Choice, draw
from service.engine.speculation import ngram_drafter
from service.engine.speculation.model_drafter import DraftAsk, ModelDrafter, RowDraft
from service.engine.speculation.step_gate import StepGate

#: ``ngram``: prompt lookup; ``int4``/``int8``: the target's own weights quantized, resident, as the draft model;
#: ``model``: a smaller checkpoint with the target's tokenizer (``--draft-model``).
SpeculationMode = Literal["off", "ngram", "int4", "int8", "model"]
SPECULATION_MODES: tuple[str, ...] = ("off", "ngram", "int4", "int8", "model")
#: The modes whose drafts come from a draft model (:mod:`.model_drafter`): a quantized copy of the target, or
#: another checkpoint.
MODEL_DRAFTS: tuple[str, ...] = ("int4", "int8", "model")

#: Decode steps a row whose draft length fell to zero waits before it probes again with one draft token.
COOLDOWN_STEPS = 8


@dataclass
class SpeculationStats:
    """Counts since the engine started (``/info`` and ``/metrics`` read them). ``verify_passes`` are rows that fed
    drafts; ``emitted`` the tokens those passes produced (accepted drafts plus the target's own token each)."""

    proposed: int = 0
    accepted: int = 0
    verify_passes: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens; None before any draft."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_pass(self) -> float | None:
        """Tokens a verify pass produced on average; None before any."""
        return self.emitted / self.verify_passes if self.verify_passes else None


@dataclass
class DraftLength:
    """One row's draft length, adapted to its acceptance: it grows by one after a pass that accepted every draft,
    halves after one that accepted none (shrinks to what was accepted plus one otherwise), and at zero rests
    :data:`COOLDOWN_STEPS` decode steps before probing with one token."""

    limit: int
    length: int = 0
    rest: int = 0

    def __post_init__(self) -> None:
        self.length = self.limit

    def current(self) -> int:
        """Draft tokens to propose this step (0: decode one token)."""
        if self.length == 0:
            self.rest -= 1
            if self.rest <= 0:
                self.length = min(1, self.limit)
            return 0
        return self.length

    def observe(self, proposed: int, accepted: int) -> None:
        if accepted == proposed:
            self.length = min(self.limit, self.length + 1)
        elif accepted == 0:
            self.length //= 2
        else:
            self.length = min(self.length, accepted + 1)
        if self.length == 0:
            self.rest = COOLDOWN_STEPS


@dataclass(frozen=True)
class Verdict:
    """What a verify pass keeps of one row: ``tokens`` (the target's choices, in order: the accepted drafts, then
    the target's own next token) and how many of them were drafts."""

    choices: tuple[Choice, ...]
    accepted: int


def accepted(drafts: Tokens[int], choices: Tokens[Choice]) -> Verdict:
    """The longest prefix of ``drafts`` equal to the target's greedy choices, plus the target's choice after it.
    ``choices[i]`` is the target's choice after the row's last token and ``drafts[:i]`` (``len(drafts) + 1`` of
    them)."""
    if len(choices) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} choices, got {len(choices)}")
    n = 0
    while n < len(drafts) and choices[n].token == drafts[n]:
        n += 1
    return Verdict(tuple(choices[: n + 1]), n)


def sampled(
    drafts: Tokens[int], probs: torch.Tensor, logprobs: torch.Tensor, generator: torch.Generator | None
) -> Verdict:
    """The standard accept/resample rule for a sampled row whose drafts are point masses (prompt lookup proposes
    one token, with certainty): draft ``x`` at position ``i`` is accepted with probability ``p_i(x)``; on the first
    rejection the token is drawn from ``p_i`` with ``x`` removed, renormalised, and the pass ends there; if every
    draft is accepted, the target's next token is drawn from ``p_d``. Each emitted token is then distributed as
    ``p_i`` given the tokens before it, exactly as without drafts. ``probs[i]`` / ``logprobs[i]`` are the target's
    sampling distribution and reported log-probabilities after the row's last token and ``drafts[:i]``. Every random
    number comes from the row's own ``generator``, in order, so a seed gives the same tokens on every run."""
    out: list[Choice] = []
    for i, x in enumerate(drafts):
        p = probs[i]
        u = float(torch.rand(1, generator=generator, dtype=torch.float64))
        if u < float(p[x]):
            out.append(Choice(int(x), float(logprobs[i, x])))
            continue
        rest = p.clone()
        rest[x] = 0.0
        if float(rest.sum()) <= 0.0:  # p(x) == 1 up to rounding: the draft is the only token left
            out.append(Choice(int(x), float(logprobs[i, x])))
            continue
        token = draw(rest, generator)
        out.append(Choice(token, float(logprobs[i, token])))
        return Verdict(tuple(out), i)
    token = draw(probs[len(drafts)], generator)
    out.append(Choice(token, float(logprobs[len(drafts), token])))
    return Verdict(tuple(out), len(drafts))


def speculable(seq: Sequence) -> bool:
    """Whether ``seq`` may decode with drafts without any change to its output (see the module docstring)."""
    request = seq.request
    params = request.params
    return (
        not params.penalised
        and seq.chooser.constraint is None
        and request.grammar is None
        and request.top_n_tokens == 0
    )


@dataclass
class _RowState:
    """What the speculator keeps for one running sequence (dropped with it)."""

    length: DraftLength
    drafter: ngram_drafter.NgramIndex | RowDraft


@dataclass
class Speculator:
    """The engine's drafting policy: ``mode`` (``off``, ``ngram``, or ``int4``/``int8``/``model`` with the ``model``
    drafter over the quantized copy or the draft checkpoint, which those modes need and the others refuse) and at most ``tokens`` drafts a row per
    pass. Keeps each running sequence's :class:`DraftLength` and drafter state (n-gram index or the copy's KV),
    the engine's :class:`SpeculationStats`, and the seconds this step spent drafting (``step_draft_seconds``: the
    gate weighs a drafting step with them, since a draft model's forwards are not free)."""

    mode: SpeculationMode = "off"
    tokens: int = RESIDENT_DRAFT_TOKENS
    model: ModelDrafter | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    gate: StepGate = field(default_factory=StepGate)
    step_draft_seconds: float = 0.0
    _greedy_allowed: int = 0
    _rows: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"unknown speculation mode {self.mode!r}; use one of {', '.join(SPECULATION_MODES)}")
        if self.mode in MODEL_DRAFTS and self.model is None:
            what = "a draft model" if self.mode == "model" else "a quantized copy of the target"
            raise ValueError(f"speculation mode {self.mode!r} drafts with {what}; pass it")
        if self.mode not in MODEL_DRAFTS and self.model is not None:
            raise ValueError(
                f"speculation mode {self.mode!r} drafts without a model; a draft model needs int4, int8 or model"
            )
        if self.tokens < 1:
            raise ValueError(f"speculation needs at least one draft token a pass (got {self.tokens})")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def begin_step(self, decode_rows: int) -> None:
        """A step with ``decode_rows`` decode rows is being scheduled: how many of its greedy rows may draft
        (:class:`~.step_gate.StepGate`)."""
        self._greedy_allowed = self.gate.allowed(decode_rows) if self.enabled and decode_rows else 0
        self.step_draft_seconds = 0.0

    def drafts(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """The tokens each of ``seqs`` drafts this step, at most its ``rooms`` entry (what its token and KV limits
        leave after the target's own next token); empty for a row that does not speculate. A draft model drafts
        the rows together (:meth:`~.model_drafter.ModelDrafter.propose`)."""
        out: list[list[int]] = [[] for _ in seqs]
        asks: list[tuple[int, _RowState, list[int], int]] = []
        greedy = self._greedy_drafters(seqs, rooms)
        for i, (seq, room) in enumerate(zip(seqs, rooms)):
            state = self._state(seq, room, i in greedy)
            if state is not None:
                want = max(min(state.length.current(), room), 0)
                asks.append((i, state, seq.request.prompt_ids + seq.generated, want))
        if not asks:
            return out
        started = time.perf_counter()
        prefill = 0.0
        if self.model is not None:
            batch = self.model.propose([DraftAsk(state.drafter, tokens, want) for _, state, tokens, want in asks])
            found, prefill = batch.drafts, batch.prefill_seconds
        else:
            # called every step, drafting or not: the n-gram index follows, so a later lookup has nothing to catch
            # up on (the draft model runs nothing for want 0; its slot catches up at its next draft)
            found = [state.drafter.propose(tokens, want) for _, state, tokens, want in asks]
        self.step_draft_seconds += time.perf_counter() - started - prefill
        for (i, *_), drafts in zip(asks, found):
            out[i] = drafts
        return out

    def _greedy_drafters(self, seqs: list[Sequence], rooms: list[int]) -> set[int]:
        """Which of the step's greedy rows may draft: all, none, or as many as the gate allows, those with the
        least context the draft model must catch up on first (a probe should cost one short catch-up, not 16
        prompts)."""
        rows = [
            i
            for i, (seq, room) in enumerate(zip(seqs, rooms))
            if room > 0 and not seq.chooser.params.sampling and speculable(seq)
        ]
        if self._greedy_allowed >= len(rows):
            return set(rows)
        if self._greedy_allowed <= 0:
            return set()
        return set(sorted(rows, key=lambda i: self._behind(seqs[i]))[: self._greedy_allowed])

    def _behind(self, seq: Sequence) -> int:
        """Tokens of ``seq`` its drafter has not seen yet (all of them before its first draft)."""
        state = self._rows.get(seq)
        total = len(seq.request.prompt_ids) + len(seq.generated)
        if state is None or not isinstance(state.drafter, RowDraft):
            return total if self.model is not None else 0
        return total - len(state.drafter.held)

    def _state(self, seq: Sequence, room: int, greedy_allowed: bool) -> _RowState | None:
        """``seq``'s drafting state, made on its first draft; None for a row that does not draft this step."""
        if not self.enabled or room <= 0 or not speculable(seq):
            return None
        if not greedy_allowed and not seq.chooser.params.sampling:  # timing may decide for greedy rows only
            return None
        state = self._rows.get(seq)
        if state is None:
            drafter = self.model.row(seq.slot) if self.model is not None else ngram_drafter.NgramIndex()
            state = self._rows[seq] = _RowState(DraftLength(self.tokens), drafter)
        return state

    def report(self) -> dict[str, int | float | None]:
        """The counts and rates so far (``/info``)."""
        with self._lock:
            stats = SpeculationStats(**vars(self.stats))
        return {
            "proposed": stats.proposed,
            "accepted": stats.accepted,
            "verify_passes": stats.verify_passes,
            "acceptance_rate": stats.acceptance_rate,
            "tokens_per_pass": stats.tokens_per_pass,
        }

    def observe(self, seq: Sequence, proposed: int, verdict_accepted: int, emitted: int) -> None:
        """A verify pass of ``seq`` proposed ``proposed`` drafts, accepted ``verdict_accepted`` and produced
        ``emitted`` tokens (fewer than accepted + 1 when the sequence ended inside them)."""
        state = self._rows.get(seq)
        if state is not None:
            state.length.observe(proposed, verdict_accepted)
        with self._lock:
            self.stats.proposed += proposed
            self.stats.accepted += verdict_accepted
            self.stats.verify_passes += 1
            self.stats.emitted += emitted
