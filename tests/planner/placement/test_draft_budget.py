"""A draft model's room in the target's plan (:mod:`planner.placement.draft_budget`, issue 35): in a box smaller than
the model, the target keeps as many fewer bytes resident as the draft holds (weights, working memory, KV for every
slot), within a layer; the plan's budget and its reasons say what the draft costs; the reservation follows the
batch, never taken twice."""

from __future__ import annotations

from dataclasses import replace

from planner.api import plan_inputs
from planner.hardware.units import format_bytes
from planner.placement.draft_budget import copy_draft_budget, kv_per_token, release_draft, reserve_draft
from planner.placement.inputs import PlanInputs, resolve_inputs
from planner.placement.served_shape import choose_slots
from planner.placement.sizing import size_blocks
from planner.types import DraftBudget, Plan
from tests.planner.synthetic import llama_like

MiB = 2**20
#: ~44 MiB of fp32 weights: the 48 MiB box (less KV and activations) offloads some of them, with or without a draft
SKELETON = llama_like(layers=16, hidden=256, intermediate=688, vocab=1000)
INPUTS = PlanInputs(
    max_memory={"cpu": "48MiB", "disk": "10GiB"}, context=512, prefill_chunk=256, dtype="float32", batch_size=2
)


def _largest_block() -> int:
    resolved = resolve_inputs(SKELETON, INPUTS)
    return max(item.weight for item in size_blocks(SKELETON, resolved.workload))


def test_the_target_keeps_the_drafts_bytes_fewer_resident_and_the_plan_says_so():
    draft = copy_draft_budget(SKELETON, "int4", "float32")
    alone = plan_inputs(SKELETON, INPUTS)
    beside = plan_inputs(SKELETON, replace(INPUTS, draft=draft))
    cpu_alone, cpu_beside = alone.budget("cpu"), beside.budget("cpu")
    assert cpu_alone is not None and cpu_beside is not None
    reserved = draft.total(2, 512)
    assert reserved == draft.weights + draft.working + 2 * 512 * draft.kv_per_token
    assert cpu_beside.draft == reserved and cpu_alone.draft == 0
    assert cpu_beside.capacity == cpu_alone.capacity == 48 * MiB  # the budget shows the whole box ...
    assert cpu_beside.total <= cpu_beside.capacity  # ... and the draft inside it
    moved = cpu_alone.weights - cpu_beside.weights
    assert abs(moved - reserved) <= _largest_block(), (moved, reserved)
    assert beside.offloaded_bytes - alone.offloaded_bytes == moved  # what left the CPU streams from disk
    cost = [r for r in beside.reasons if r.startswith("draft: int4 copy")]
    assert len(cost) == 1, beside.reasons
    assert "2 slots x 512 tokens) resident on cpu; target weights on cpu -" in cost[0]
    assert cost[0].endswith(f"on disk +{format_bytes(moved)}")
    assert not any(r.startswith("draft:") for r in alone.reasons)


def test_a_roomy_box_keeps_the_target_whole_and_says_the_draft_cost_nothing():
    roomy = replace(INPUTS, max_memory={"cpu": "1GiB"})
    beside = plan_inputs(SKELETON, replace(roomy, draft=copy_draft_budget(SKELETON, "int8", "float32")))
    assert beside.offloaded_bytes == 0
    assert any(r.endswith("stay where they were (they fit beside it)") for r in beside.reasons), beside.reasons


def test_a_plan_with_a_draft_round_trips_through_json():
    beside = plan_inputs(SKELETON, replace(INPUTS, draft=DraftBudget("draft model d", "cpu", 3 * MiB, MiB, 1024)))
    again = Plan.from_json(beside.to_json())
    assert again == beside and isinstance(again.workload.draft, DraftBudget)


def test_the_reservation_follows_the_batch_and_is_never_taken_twice():
    draft = DraftBudget("d", "cpu", weights=MiB, kv_per_token=64)
    hardware = resolve_inputs(SKELETON, INPUTS).hardware
    cpu = hardware.get("cpu").capacity  # type: ignore[union-attr]
    workload = resolve_inputs(SKELETON, replace(INPUTS, draft=draft)).workload
    four = reserve_draft(hardware, replace(workload, batch_size=4))
    one = reserve_draft(four, replace(workload, batch_size=1))
    assert one.get("cpu").capacity == cpu - MiB - 64 * 512  # type: ignore[union-attr]
    assert release_draft(one) == hardware and reserve_draft(one, replace(workload, draft=None)) == hardware


def test_a_drafts_kv_per_slot_leaves_room_for_fewer_slots():
    inputs = replace(INPUTS, max_memory={"cpu": "80MiB"})
    heavy = DraftBudget("d", "cpu", weights=MiB, kv_per_token=2 * kv_per_token(SKELETON, "float32"))
    alone = choose_slots(SKELETON, inputs, 32).batch_size
    assert choose_slots(SKELETON, replace(inputs, draft=heavy), 32).batch_size < alone
