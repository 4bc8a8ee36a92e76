"""Whether drafting pays on this model and machine, measured step by step (:class:`StepGate`).

A verify pass emits more tokens than a plain step but costs more: its rows feed ``1 + d`` tokens, a draft model's
forwards run before it, and on a resident model a batch of one-token rows takes the native decode step where a
verify batch cannot. Whether the pass is worth it depends on the model's placement (a step read from disk costs its
weight reads whatever the row width; a resident one its arithmetic), on the batch width and on how often drafts are
accepted. So the gate measures it: seconds per emitted token of pure decode steps, plain and drafting.

Measuring is not free either. A draft model's copy of a row's context is only kept while the row drafts; a row that
rested must first be caught up (its whole prompt, on a first draft), which on 16 rows of a few hundred tokens costs
more than a dozen plain steps. So a shut gate probes with **one** row (the one with least to catch up), and only a
probe that pays earns a trial with every row. Row counts the gate has not compared yet borrow the verdict of the
nearest count it has within a quarter of their own: a batch that shrinks by one as a request finishes is not a new
machine, but 16 rows are not 2 (a 2-row verdict that drafting pays once opened 64 steps of 16 rows drafting, each
catching up, before the gate had measured a plain 16-row step to compare with).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Weight of the newest step in the gate's moving averages.
SMOOTHING = 0.2
#: Steps the gate stays shut before it lets one row draft to measure again ...
PROBE_EVERY = 64
#: ... doubled after each probe that found drafting still dearer, up to this (a probe costs its row's catch-up and
#: a verify pass, which on a model where drafts never pay should not recur every 64 steps).
MAX_PROBE_EVERY = 1024
#: A row count not compared yet borrows the verdict of a compared count at most this fraction of it away.
BORROW_WITHIN = 0.25


@dataclass
class StepGate:
    """How many of a step's greedy rows may draft (:meth:`allowed`), from the seconds per emitted token of pure
    decode steps (:meth:`observe`): plain ones, ones where every row could draft, and probes where one row did, per
    count of decode rows (a step of 16 rows costs more than one of 1, whatever it drafts).

    While steps with drafts cost no more per token than plain ones, every row drafts, but for one plain step in
    :data:`PROBE_EVERY` (rows whose drafts are always accepted would otherwise never run a plain step, and the plain
    cost must stay current). While they cost more, no row drafts, but for a one-row probe every :data:`PROBE_EVERY`
    steps, an interval that doubles up to :data:`MAX_PROBE_EVERY` while probes keep finding drafts dearer; a probe
    that pays is followed by one step where every row drafts, to measure that again. Before anything is measured the
    first step is a probe. It gates greedy rows only: whether a sampled row drafts changes which random numbers it
    draws, so that must not depend on timing (a seed would no longer give the same tokens); a sampled row's
    drafting follows its own acceptance alone (:class:`~.verification.DraftLength`)."""

    #: False: every row may always draft (tests that must see drafts whatever the timing).
    measure: bool = True
    plain: dict[int, float] = field(default_factory=dict)  # decode rows -> seconds per token, steps without drafts
    drafted: dict[int, float] = field(default_factory=dict)  # the same, steps where every row could draft
    probed: dict[int, float] = field(default_factory=dict)  # the same, one-row probes of a wider batch
    shut_steps: int = 0
    open_steps: int = 0
    probe_every: int = PROBE_EVERY
    #: A probe paid since the last step where every row could draft: the next step lets every row draft.
    trial: bool = False
    #: What the last :meth:`allowed` answered and for how many rows (:meth:`observe` files the step by it).
    last_allowed: int = 0
    last_rows: int = 0

    def allowed(self, rows: int) -> int:
        """How many of a step's ``rows`` decode rows' greedy rows may draft: ``rows`` (every one), 1 (a probe) or 0."""
        self.last_rows = rows
        self.last_allowed = self._decide(rows) if self.measure else rows
        return self.last_allowed

    def _decide(self, rows: int) -> int:
        full, probe = self._ratio(self.drafted, rows), self._ratio(self.probed, rows)
        if full is None and probe is None:  # nothing compared yet: a plain step to compare with, or a probe
            return 0 if rows not in self.plain and (self.drafted or self.probed) else 1
        if full is not None and full <= 1.0:
            self.probe_every = PROBE_EVERY
            self.open_steps += 1
            if self.open_steps >= PROBE_EVERY:  # a plain step, to keep the plain cost current
                self.open_steps = 0
                return 0
            return rows
        if self.trial or (full is None and probe is not None and probe <= 1.0):
            self.trial = False
            return rows
        self.shut_steps += 1
        if self.shut_steps >= self.probe_every:
            self.shut_steps = 0
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)  # back to 64 once drafting pays
            return 1
        return 0

    def _ratio(self, table: dict[int, float], rows: int) -> float | None:
        """Seconds per token in ``table`` over those of plain steps, at the row count nearest ``rows`` where both
        were measured, within :data:`BORROW_WITHIN` of ``rows``; None where none was."""
        both = [r for r in table if r in self.plain and abs(r - rows) <= BORROW_WITHIN * rows]
        if not both:
            return None
        near = min(both, key=lambda r: (abs(r - rows), r))
        return table[near] / self.plain[near]

    def observe(self, rows: int, seconds: float, tokens: int, drafted: bool) -> None:
        """A pure decode step of ``rows`` rows took ``seconds`` and emitted ``tokens`` tokens; ``drafted``: some
        row fed drafts. Filed by what :meth:`allowed` answered for it."""
        if tokens <= 0:
            return
        probe = drafted and rows > 1 and rows == self.last_rows and self.last_allowed == 1
        table = self.probed if probe else self.drafted if drafted else self.plain
        old, new = table.get(rows), seconds / tokens
        table[rows] = new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
        if probe and rows in self.plain and table[rows] <= self.plain[rows]:
            self.trial = True
