"""Choosing the next token of every sequence of a batch in one pass over its logits ``[B, V]``.

Each row carries its own settings in a :class:`TokenChooser`: greedy or sampled (temperature, top-k, top-p,
typical-p), penalties (repetition as in TGI/transformers; frequency and presence as in OpenAI), a grammar
constraint, how many alternatives to report, and its own seeded generator. The work is done once for the whole
batch (masks, penalties, softmax, truncation, inverse-CDF sampling); only the random draw is per row: one uniform
number from the row's own generator. So a seeded sequence gets the same tokens whatever its batch-mates are.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature``/``top_k``/``top_p``/``typical_p`` are ``None`` when not set.

    As in TGI, setting any warper (a temperature other than 1, top_k, top_p < 1, typical_p < 1) turns sampling on;
    ``temperature == 0`` (allowed by the OpenAI routes) means greedy.

    ``min_p`` (vLLM) keeps, when sampling, the tokens at least ``min_p`` times as likely as the likeliest one (after
    temperature). ``logit_bias`` (OpenAI) adds its bias to a token's logit before the penalties and temperature, so
    it moves greedy choices too; -100 all but bans a token, +100 all but forces it.

    ``frequency_penalty`` and ``presence_penalty`` follow OpenAI: each generated occurrence of a token lowers its
    logit by ``frequency_penalty``, and any occurrence by ``presence_penalty`` once. ``repetition_penalty``
    follows transformers/TGI: the logits of tokens seen in the prompt or output are divided (positive) or
    multiplied (negative) by it.
    """

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    #: vLLM's ``min_p``: when sampling, drop tokens less likely than ``min_p`` times the likeliest one.
    min_p: float | None = None
    #: OpenAI's ``logit_bias``: (token id, bias) pairs added to the logits before anything else (greedy included).
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def sampling(self) -> bool:
        if self.temperature == 0:
            return False
        if self.do_sample:
            return True
        return (
            (self.temperature is not None and self.temperature != 1.0)
            or bool(self.top_k)
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.typical_p is not None and self.typical_p < 1.0)
        )

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty not in (None, 1.0)
            or self.frequency_penalty not in (None, 0.0)
            or self.presence_penalty not in (None, 0.0)
        )


@dataclass(frozen=True)
class TokenLogprob:
    """A token id and its log-probability (an alternative the client asked to see)."""

    id: int
    logprob: float


@dataclass(frozen=True)
class Choice:
    """The token chosen for one row, its log-probability and the row's most likely tokens (best first)."""

    token: int
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


class Constraint(Protocol):
    """A grammar that restricts a sequence's next token (see :mod:`service.engine.structured_output`)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, token: int) -> bool: ...
    @property
    def terminated(self) -> bool: ...


@dataclass
class TokenChooser:
    """Per-sequence state for choosing tokens: settings, generator, seed used, penalty counts, constraint.

    ``last`` is the most recent :class:`Choice` made for this sequence (the engine reads its alternatives).
    """

    params: SamplingParams
    seed: int | None = None
    generator: torch.Generator | None = field(default=None, repr=False)
    top_n: int = 0
    constraint: Constraint | None = None
    prompt_ids: Sequence[int] = ()
    last: Choice | None = None
    _seen: torch.Tensor | None = field(default=None, repr=False)  # [V] bool: in prompt or output (repetition)
    _counts: torch.Tensor | None = field(default=None, repr=False)  # [V] float: occurrences in the output
    _early: list[int] = field(default_factory=list, repr=False)  # accepted before the counts existed

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        *,
        top_n: int = 0,
        constraint: Constraint | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> TokenChooser:
        seed, gen = None, None
        if params.sampling:
            seed = params.seed if params.seed is not None else random.SystemRandom().randrange(0, 2**63 - 1)
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return cls(params=params, seed=seed, generator=gen, top_n=top_n, constraint=constraint, prompt_ids=prompt_ids)

    def accept(self, token: int) -> bool:
        """Record a chosen token: penalty counts and the grammar advance. False if the grammar rejects it."""
        self._count(token)
        if self.constraint is not None:
            return self.constraint.accept(token)
        return True

    def _count(self, token: int) -> None:
        if self._counts is None:
            if self.params.penalised:
                self._early.append(token)
        elif 0 <= token < self._counts.numel():
            self._counts[token] += 1
            self._seen[token] = True

    def _penalty_state(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None or self._counts.numel() != vocab:
            self._seen = torch.zeros(vocab, dtype=torch.bool)
            ids = [t for t in self.prompt_ids if 0 <= t < vocab]
            if ids:
                self._seen[torch.tensor(ids, dtype=torch.long)] = True
            self._counts = torch.zeros(vocab, dtype=torch.float32)
            early, self._early = self._early, []
            for token in early:
                self._count(token)
        return self._seen, self._counts

    def choose(self, logits: torch.Tensor) -> Choice:
        """One row alone (1-D logits); the same computation as a batch of one."""
        return choose_batch(logits.unsqueeze(0), [self])[0]


def choose_batch(logits: torch.Tensor, choosers: Sequence[TokenChooser]) -> list[Choice]:
    """The next token of every row of ``logits`` (``[B, V]``), each by its own chooser; sets each ``last``.

    A row's ``logprob`` is the log-probability of its token under the distribution after the grammar mask,
    penalties and temperature, before top-k/top-p/typical truncation (alternatives are from the same distribution).
    """
    vocab = logits.shape[1]
    logprobs = _scored_logprobs(logits, choosers)
    tokens = logprobs.argmax(dim=-1)
    sampled = [r for r, c in enumerate(choosers) if c.params.sampling]
    if sampled:
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        kept = _truncate(logprobs.index_select(0, idx), [choosers[r].params for r in sampled])
        tokens[idx] = draw_rows(torch.softmax(kept, dim=-1), [choosers[r].generator for r in sampled])
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_k = max((c.top_n for c in choosers), default=0)
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    if top_k:
        values, ids = torch.topk(logprobs, min(top_k, vocab), dim=-1)
        top_ids, top_lps = ids.tolist(), values.tolist()
    out = []
    for r, (token, lp) in enumerate(zip(tokens.tolist(), chosen.tolist())):
        n = choosers[r].top_n
        # A token the grammar mask rules out (logprob -inf) is no alternative, and JSON cannot carry -inf.
        top = tuple(TokenLogprob(i, v) for i, v in zip(top_ids[r][:n], top_lps[r][:n]) if v > NEG_INF) if n else ()
        choice = Choice(token=int(token), logprob=float(lp), top=top)
        choosers[r].last = choice
        out.append(choice)
    return out


def target_distributions(logits: torch.Tensor, choosers: Sequence[TokenChooser]) -> tuple[torch.Tensor, torch.Tensor]:
    """For sampled rows without penalties or grammar (speculative verification): each row's log-probabilities as
    :func:`choose_batch` reports them (after logit bias and temperature) and the probabilities it samples from
    (after top-k/top-p/typical/min-p, renormalised), both ``[B, V]``. The same steps as :func:`choose_batch`."""
    if any(c.constraint is not None or c.params.penalised for c in choosers):
        raise ValueError("target_distributions takes rows without grammar or penalties")
    logprobs = _scored_logprobs(logits, choosers)
    kept = _truncate(logprobs.clone(), [c.params for c in choosers])
    return logprobs, torch.softmax(kept, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (``[V]``, not necessarily normalised): :func:`draw_rows` for one row."""
    return int(draw_rows(probs.unsqueeze(0), [generator])[0])


def draw_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` (``[R, V]``, rows not necessarily normalised) by inverse CDF, with one
    uniform number from each row's own generator, so a seeded row draws the same whatever it is batched with."""
    cdf = probs.double().cumsum(dim=-1)
    draws = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(cdf.device)
    picks = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return picks.clamp(max=probs.shape[-1] - 1)


def _scored_logprobs(logits: torch.Tensor, choosers: Sequence[TokenChooser]) -> torch.Tensor:
    """Each row's log-probabilities after its logit bias, grammar mask, penalties and temperature (``[B, V]``,
    float32): what a row's ``logprob`` reports, and what top-k/top-p/typical/min-p then truncate to sample."""
    in_place = any(c.constraint is not None or c.params.penalised or c.params.logit_bias for c in choosers)
    scores = logits.detach().to(torch.float32, copy=in_place)  # masks and penalties write into it
    _apply_logit_bias(scores, choosers)
    _apply_constraints(scores, choosers)
    _apply_penalties(scores, choosers)
    temps = [c.params.temperature if c.params.sampling and c.params.temperature else 1.0 for c in choosers]
    if any(t != 1.0 for t in temps):
        scores = scores / torch.tensor(temps, dtype=torch.float32, device=scores.device).unsqueeze(1)
    return torch.log_softmax(scores, dim=-1)


def _apply_logit_bias(scores: torch.Tensor, choosers: Sequence[TokenChooser]) -> None:
    """Add each row's ``logit_bias`` (in place); ids beyond the logits' width are ignored."""
    vocab = scores.shape[1]
    for r, c in enumerate(choosers):
        pairs = [(i, b) for i, b in c.params.logit_bias if 0 <= i < vocab]
        if pairs:
            ids = torch.tensor([i for i, _ in pairs], dtype=torch.long, device=scores.device)
            bias = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=scores.device)
            scores[r].index_add_(0, ids, bias)


def _apply_constraints(scores: torch.Tensor, choosers: Sequence[TokenChooser]) -> None:
    """Mask (in place) the tokens each constrained row's grammar does not allow next."""
    rows = [r for r, c in enumerate(choosers) if c.constraint is not None]
    if not rows:
        return
    from service.engine.structured_output import apply_bitmask, new_bitmask

    bitmask = new_bitmask(scores.shape[0], scores.shape[1])
    for r in rows:
        choosers[r].constraint.fill_bitmask(bitmask, r)  # type: ignore[union-attr]
    apply_bitmask(scores, bitmask, rows)


def _apply_penalties(scores: torch.Tensor, choosers: Sequence[TokenChooser]) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that set any."""
    rows = [r for r, c in enumerate(choosers) if c.params.penalised]
    if not rows:
        return
    vocab = scores.shape[1]
    states = [choosers[r]._penalty_state(vocab) for r in rows]
    dev = scores.device
    seen = torch.stack([s for s, _ in states]).to(dev)
    counts = torch.stack([c for _, c in states]).to(dev)

    def column(name: str, neutral: float) -> torch.Tensor:
        values = [getattr(choosers[r].params, name) for r in rows]
        column = [neutral if v is None else v for v in values]
        return torch.tensor(column, dtype=torch.float32, device=dev).unsqueeze(1)

    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    sub = scores.index_select(0, idx)
    rep = column("repetition_penalty", 1.0)
    sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
    sub = sub - column("frequency_penalty", 0.0) * counts - column("presence_penalty", 0.0) * (counts > 0).float()
    scores.index_copy_(0, idx, sub)


#: Top-k/top-p look for their cutoff among this many likeliest tokens first (``topk``, far cheaper than sorting a
#: whole vocabulary); only a row whose top-p nucleus is wider than that sorts everything.
CANDIDATES = 256


def _truncate(logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask out (with -inf, in place) what top-k, then top-p, then typical-p, then min-p exclude, each row by its own settings, batched
    over the rows that use each. Each step sees the distribution the previous one left, renormalised; the most
    likely token always stays (tokens tied with the last one kept stay too)."""
    vocab = logprobs.shape[1]
    dev = logprobs.device
    ks = [min(int(p.top_k), vocab) if p.top_k else vocab for p in params]
    ps = [p.top_p if p.top_p is not None and p.top_p < 1.0 else 1.0 for p in params]
    rows = [r for r in range(len(params)) if ks[r] < vocab or ps[r] < 1.0]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        sub = logprobs.index_select(0, idx)
        k = torch.tensor([ks[r] for r in rows], device=dev)
        p = torch.tensor([ps[r] for r in rows], dtype=torch.float32, device=dev)
        width = min(vocab, max([CANDIDATES] + [ks[r] for r in rows if ks[r] < vocab]))
        cutoff, overflow = _cutoff(sub, k, p, width)
        if width < vocab and bool(overflow.any()):
            wide = torch.nonzero(overflow).flatten()
            cutoff[wide] = _cutoff(sub[wide], k[wide], p[wide], vocab)[0]
        logprobs.index_copy_(0, idx, sub.masked_fill(sub < cutoff.unsqueeze(1), NEG_INF))
    typical = [p.typical_p if p.typical_p is not None and p.typical_p < 1.0 else 1.0 for p in params]
    rows = [r for r, t in enumerate(typical) if t < 1.0]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        sub = logprobs.index_select(0, idx)
        current = torch.log_softmax(sub, dim=-1)
        probs = current.exp()
        finite = torch.isfinite(current)
        entropy = -torch.where(finite, probs * current, torch.zeros_like(current)).sum(dim=-1, keepdim=True)
        surprise = torch.where(finite, (-current - entropy).abs(), torch.full_like(current, float("inf")))
        order = torch.argsort(surprise, dim=-1)
        ordered = probs.gather(1, order)
        before = ordered.cumsum(dim=-1) - ordered
        drop = before >= torch.tensor([typical[r] for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)
        drop[:, 0] = False
        mask = torch.zeros_like(drop).scatter(1, order, drop)
        logprobs.index_copy_(0, idx, sub.masked_fill(mask, NEG_INF))
    rows = [r for r, p in enumerate(params) if p.min_p]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        sub = logprobs.index_select(0, idx)
        floor = torch.tensor([math.log(params[r].min_p) for r in rows], dtype=torch.float32, device=dev)
        cutoff = sub.max(dim=-1).values + floor
        logprobs.index_copy_(0, idx, sub.masked_fill(sub < cutoff.unsqueeze(1), NEG_INF))
    return logprobs


def _cutoff(logprobs: torch.Tensor, k: torch.Tensor, p: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest logprob top-k then top-p keep, found among the ``width`` likeliest tokens; and whether
    that was too narrow to be sure (the nucleus reached ``width`` tokens with no top-k to stop it)."""
    top = torch.topk(logprobs, width, dim=-1).values  # sorted, likeliest first
    rank = torch.arange(width, device=logprobs.device).unsqueeze(0)
    in_k = rank < k.unsqueeze(1)
    limited = k < width  # rows whose top-k set lies inside ``top``: renormalise over it, else over the whole row
    norm = torch.where(
        limited,
        torch.logsumexp(top.masked_fill(~in_k, NEG_INF), dim=-1),
        torch.logsumexp(logprobs, dim=-1),
    )
    probs = torch.exp(top - norm.unsqueeze(1)).masked_fill(~in_k, 0.0)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    keep = in_k & (before < p.unsqueeze(1))
    keep[:, 0] = True
    count = keep.sum(dim=-1)
    cutoff = top.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
    return cutoff, (count == width) & ~limited
