"""Speculative decoding's predicted tokens/s for one stream: a draft proposes k tokens, one target pass checks them.

Why a formula: the plan is made before anything runs, and what a draft buys depends on one number the plan cannot
know, the share of draft tokens the target accepts. So the plan predicts at a stated default acceptance, and
``/info`` predicts again from the acceptance measured so far (``speculation.predicted_tokens_per_s``).

The model: decode is bound by the bytes a step reads, and a verify pass of k + 1 tokens reads the target's weights
once, so it costs one plain step of the cost model (the lone stream's). Each draft token costs the draft's resident
bytes over the memory rate of its device. With per-token acceptance ``a``, a pass yields the accepted prefix of
the drafts plus the target's own token: ``(1 - a^(k+1)) / (1 - a)`` tokens on average. It ignores the products
of the k extra tokens, which is right where the weights stream from disk (the case the copy is for) and
optimistic on a fast resident model, where the engine's gate stops drafting that does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.types import Plan

#: The acceptance the plan assumes before any draft was verified: about what the quantized copies of a trained
#: model reach (the trained demo model's int4 copy: 0.82-0.84; its int8 copy: 0.93-0.95).
DEFAULT_ACCEPTANCE = 0.7
#: Draft tokens a row proposes at most per verify pass where the server was not told (``--speculate-tokens``), for
#: a target held where it computes, and for one whose weights stream (from disk, or to the GPUs). A streamed pass
#: reads the streamed weights once however many drafts it verifies, so more drafts a pass pay there: the 1.03B fp32
#: in a 3 GiB box with its int4 copy drafting went from 5.53 tok/s at 4 to 6.38 at 8 (docs/benchmarks.md).
RESIDENT_DRAFT_TOKENS = 4
STREAMED_DRAFT_TOKENS = 8


def tokens_per_pass(acceptance: float, draft_tokens: int) -> float:
    """Expected tokens one verify pass yields: the accepted prefix of ``draft_tokens`` drafts, plus one."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(draft_tokens + 1)
    return (1.0 - a ** (draft_tokens + 1)) / (1.0 - a)


def speculative_tokens_per_s(
    step_seconds: float, draft_token_seconds: float, draft_tokens: int, acceptance: float = DEFAULT_ACCEPTANCE
) -> float:
    """One stream's tokens/s when each pass of ``step_seconds`` (a plain decode step) follows ``draft_tokens``
    drafts of ``draft_token_seconds`` each and ``acceptance`` of drafts are accepted."""
    return tokens_per_pass(acceptance, draft_tokens) / (step_seconds + draft_tokens * draft_token_seconds)


@dataclass(frozen=True)
class SpeculativePrediction:
    """One stream's predicted tokens/s with the draft (``tokens_per_s``) and the acceptance it is at."""

    tokens_per_s: float
    acceptance: float


def current_prediction(plan: Plan, measured: float | None) -> SpeculativePrediction | None:
    """The plan's speculative prediction, redone at the ``measured`` acceptance where drafts were verified; None
    for a plan without a draft model."""
    prediction, draft = plan.prediction, plan.workload.draft
    if not prediction.speculative_tokens_per_s or prediction.speculative_acceptance is None or draft is None:
        return None
    if measured is None:
        return SpeculativePrediction(prediction.speculative_tokens_per_s, prediction.speculative_acceptance)
    rate = at_acceptance(prediction.speculative_tokens_per_s, prediction.speculative_acceptance, measured, draft.tokens)
    return SpeculativePrediction(round(rate, 4), measured)


def at_acceptance(predicted: float, assumed: float, measured: float, draft_tokens: int) -> float:
    """A prediction made at acceptance ``assumed`` redone at ``measured``: the seconds a pass takes do not depend
    on how many of its drafts are accepted, only the tokens it yields."""
    seconds_per_pass = tokens_per_pass(assumed, draft_tokens) / predicted
    return tokens_per_pass(measured, draft_tokens) / seconds_per_pass


def draft_tokens(asked: int | None, plan: Plan | None) -> int:
    """Most drafts a pass verifies: ``asked`` (``--speculate-tokens``) where given, else more where ``plan`` streams
    weights (None: not planned yet)."""
    if asked is not None:
        return asked
    return STREAMED_DRAFT_TOKENS if plan is not None and plan.offloaded_bytes > 0 else RESIDENT_DRAFT_TOKENS


def with_draft_tokens(plan: Plan, count: int) -> Plan:
    """``plan`` with its draft verifying ``count`` drafts a pass, the speculative prediction redone for them: a
    pass is one plain step plus one draft-token time per draft, so the draft-token time comes out of the prediction
    made for the old count (unchanged where the plan has no draft or no prediction of it)."""
    prediction, draft = plan.prediction, plan.workload.draft
    if draft is None or draft.tokens == count:
        return plan
    workload = replace(plan.workload, draft=replace(draft, tokens=count))
    rate, acceptance, lone = (
        prediction.speculative_tokens_per_s,
        prediction.speculative_acceptance,
        prediction.lone_decode_tokens_per_s,
    )
    if not rate or acceptance is None or not lone:
        return replace(plan, workload=workload)
    step = 1.0 / lone
    draft_seconds = max(tokens_per_pass(acceptance, draft.tokens) / rate - step, 0.0) / draft.tokens
    redone = speculative_tokens_per_s(step, draft_seconds, count, acceptance)
    return replace(plan, workload=workload, prediction=replace(prediction, speculative_tokens_per_s=round(redone, 4)))
