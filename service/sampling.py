"""Choosing the next token of one sequence from its logits: greedy or sampled, with TGI's parameters.

Each sequence is chosen on its own row of logits, with its own seeded generator, so a sequence's result never
depends on which other sequences share its decode step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature``/``top_k``/``top_p``/``typical_p`` are ``None`` when not set.

    As in TGI, setting any warper (a temperature other than 1, top_k, top_p < 1, typical_p < 1) turns sampling on;
    ``temperature == 0`` (allowed by the OpenAI routes) means greedy.
    """

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

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


@dataclass
class TokenChooser:
    """Per-sequence state for choosing tokens: the params, the generator and the seed actually used."""

    params: SamplingParams
    seed: int | None = None
    generator: torch.Generator | None = field(default=None, repr=False)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that depends on the sequence's history: can be chosen batched."""
        return not self.params.sampling and self.params.repetition_penalty in (None, 1.0)

    @classmethod
    def create(cls, params: SamplingParams) -> TokenChooser:
        if not params.sampling:
            return cls(params=params)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(0, 2**63 - 1)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed))
        return cls(params=params, seed=int(seed), generator=gen)

    def choose(self, logits: torch.Tensor, history: torch.Tensor | None) -> tuple[int, float]:
        """Return ``(token_id, logprob)`` for one row of logits (1-D, vocab-sized).

        ``logprob`` is the log-probability of the chosen token under the model's distribution after the
        repetition penalty and temperature, before top-k/top-p/typical truncation.
        """
        scores = logits.float()
        p = self.params
        if p.repetition_penalty is not None and p.repetition_penalty != 1.0 and history is not None and history.numel():
            idx = history.to(scores.device).unique()
            picked = scores.index_select(0, idx)
            picked = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
            scores = scores.clone()
            scores.index_copy_(0, idx, picked)
        if not p.sampling:
            token = int(torch.argmax(scores).item())
            logprob = float(torch.log_softmax(scores, dim=-1)[token].item())
            return token, logprob

        if p.temperature is not None and p.temperature not in (0.0, 1.0):
            scores = scores / p.temperature
        logprobs = torch.log_softmax(scores, dim=-1)
        filtered = _truncate(logprobs.clone(), p)
        probs = torch.softmax(filtered, dim=-1).cpu()
        token = int(torch.multinomial(probs, 1, generator=self.generator).item())
        return token, float(logprobs[token].item())


def _truncate(logprobs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Mask out (with -inf) the tokens top-k, top-p and typical-p exclude. Always keeps the most likely token."""
    neg = float("-inf")
    if p.top_k:
        k = min(int(p.top_k), logprobs.numel())
        kth = torch.topk(logprobs, k).values[-1]
        logprobs = logprobs.masked_fill(logprobs < kth, neg)
    if p.top_p is not None and p.top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, descending=True)
        cum = torch.cumsum(sorted_lp.exp(), dim=-1)
        drop = (cum - sorted_lp.exp()) >= p.top_p  # tokens whose predecessors already cover top_p
        drop[0] = False
        logprobs = logprobs.clone()
        logprobs[order[drop]] = neg
    if p.typical_p is not None and p.typical_p < 1.0:
        probs = logprobs.exp()
        finite = torch.isfinite(logprobs)
        entropy = -(probs[finite] * logprobs[finite]).sum()
        surprise = (-logprobs - entropy).abs()
        order = torch.argsort(surprise)
        cum = torch.cumsum(probs[order], dim=-1)
        drop = (cum - probs[order]) >= p.typical_p
        drop[0] = False
        logprobs = logprobs.clone()
        logprobs[order[drop]] = neg
    return logprobs
