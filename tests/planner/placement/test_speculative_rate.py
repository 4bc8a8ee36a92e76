"""The speculative prediction: tokens a verify pass yields at an acceptance, and the plan's rate with a draft."""

from __future__ import annotations

import math

import pytest

from planner.api import plan_inputs
from planner.placement.inputs import PlanInputs
from planner.placement.speculative_rate import (
    DEFAULT_ACCEPTANCE,
    RESIDENT_DRAFT_TOKENS,
    STREAMED_DRAFT_TOKENS,
    at_acceptance,
    current_prediction,
    draft_tokens,
    speculative_tokens_per_s,
    tokens_per_pass,
    with_draft_tokens,
)
from planner.types import DraftBudget
from tests.models import tiny_llama_dir


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.95])
def test_tokens_per_pass_is_the_expected_accepted_prefix_plus_one(a):
    k = 4
    # P(exactly j drafts accepted) = a^j (1 - a) for j < k, a^k for all k; the pass yields j + 1 tokens
    expected = sum((j + 1) * a**j * (1 - a) for j in range(k)) + (k + 1) * a**k
    assert math.isclose(tokens_per_pass(a, k), expected, rel_tol=1e-12)
    assert tokens_per_pass(1.0, k) == k + 1 and tokens_per_pass(0.0, k) == 1


def test_a_pass_costs_a_step_and_its_drafts():
    assert math.isclose(speculative_tokens_per_s(1.0, 0.05, 4, 1.0), 5 / 1.2)
    # redone at another acceptance: the pass takes as long, it yields more or fewer tokens
    first = speculative_tokens_per_s(1.0, 0.05, 4, 0.7)
    assert math.isclose(at_acceptance(first, 0.7, 0.9, 4), speculative_tokens_per_s(1.0, 0.05, 4, 0.9))


def test_the_plan_predicts_with_its_draft_at_the_stated_acceptance():
    draft = DraftBudget(label="int4 copy", device="cpu", weights=50 << 20, working=1 << 20, kv_per_token=1024, tokens=3)
    inputs = PlanInputs(max_memory={"cpu": "8GiB"}, draft=draft)
    plan = plan_inputs(str(tiny_llama_dir()), inputs)
    p = plan.prediction
    assert p.speculative_acceptance == DEFAULT_ACCEPTANCE
    cpu = next(d for d in inputs.hardware().devices if d.id == "cpu")
    want = speculative_tokens_per_s(1 / p.lone_decode_tokens_per_s, draft.weights / cpu.bandwidth, 3)
    assert math.isclose(p.speculative_tokens_per_s, want, rel_tol=1e-3)
    measured = current_prediction(plan, 0.95)
    assert measured.acceptance == 0.95 and measured.tokens_per_s > p.speculative_tokens_per_s
    assert current_prediction(plan, None).tokens_per_s == p.speculative_tokens_per_s
    plain = plan_inputs(str(tiny_llama_dir()), PlanInputs(max_memory={"cpu": "8GiB"}))
    assert plain.prediction.speculative_tokens_per_s is None and current_prediction(plain, 0.9) is None


def test_more_drafts_a_pass_by_default_where_the_plan_streams_and_the_prediction_follows():
    """A plan that streams weights (disk) takes 8 drafts a pass by default, a resident one 4; the prediction redone
    for 8 keeps the step and the draft-token time the plan predicted with, and is what the plan predicts when made
    for 8 from the start."""
    draft = DraftBudget(label="int4 copy", device="cpu", weights=50 << 20, working=1 << 20, kv_per_token=1024, tokens=4)
    resident = plan_inputs(str(tiny_llama_dir()), PlanInputs(max_memory={"cpu": "8GiB"}, draft=draft))
    assert resident.offloaded_bytes == 0 and draft_tokens(None, resident) == RESIDENT_DRAFT_TOKENS
    assert draft_tokens(None, None) == RESIDENT_DRAFT_TOKENS
    strategy = {"model.layers.2": "disk", "model.layers.3": "disk", "": "cpu"}
    box = PlanInputs(max_memory={"cpu": "8GiB", "disk": "8GiB"}, draft=draft, strategy=strategy)
    streamed = plan_inputs(str(tiny_llama_dir()), box)
    assert streamed.offloaded_bytes > 0 and draft_tokens(None, streamed) == STREAMED_DRAFT_TOKENS
    redone = with_draft_tokens(streamed, STREAMED_DRAFT_TOKENS)
    assert redone.workload.draft.tokens == STREAMED_DRAFT_TOKENS and streamed.workload.draft.tokens == 4
    direct = plan_inputs(
        str(tiny_llama_dir()),
        PlanInputs(
            max_memory=box.max_memory,
            strategy=strategy,
            draft=DraftBudget(**{**draft.__dict__, "tokens": STREAMED_DRAFT_TOKENS}),
        ),
    )
    assert math.isclose(
        redone.prediction.speculative_tokens_per_s, direct.prediction.speculative_tokens_per_s, rel_tol=1e-3
    )
    assert with_draft_tokens(streamed, 4) is streamed
