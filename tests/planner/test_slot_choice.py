"""The shape a server plans for when not told (:mod:`planner.placement.served_shape`): how many KV slots (between one
sequence of the full context and ``--max-batch-size``) and how large a prefill step, the most that do not slow a
lone stream by more than 10%."""

from __future__ import annotations

from dataclasses import replace

from planner.api import plan_inputs
from planner.errors import PlanError
from planner.placement.inputs import PlanInputs
from planner.placement.served_shape import MIN_PREFILL_CHUNK, SPEED_FLOOR, choose_slots, choose_step, lone_speed
from planner.types import PREFILL_CHUNK
from tests.planner.synthetic import llama_like

MiB = 2**20
SKELETON = llama_like(layers=8, hidden=512, intermediate=1376, vocab=4000)  # ~40 MiB of fp32 weights


def _inputs(cpu: str, disk: bool) -> PlanInputs:
    memory = {"cpu": cpu, **({"disk": "10GiB"} if disk else {})}
    return PlanInputs(max_memory=memory, context=2048, prefill_chunk=PREFILL_CHUNK, dtype="float32")


def _lone_speeds(inputs: PlanInputs) -> dict[int, float]:
    """A lone stream's predicted speed on the placement made for each fitting number of slots (the plan's figure
    at batch 1 is not that: it would place for one slot)."""
    from planner.placement.cost_model import compute_dtype
    from planner.placement.inputs import resolve_inputs
    from planner.placement.solve import make_problem, solve

    resolved = resolve_inputs(SKELETON, inputs)
    lone = replace(resolved.workload, batch_size=1)
    problem = make_problem(resolved.skeleton, resolved.hardware, lone)
    speeds = {}
    for batch in (1, 2, 4, 8, 16, 32):
        solution = solve(replace(resolved, workload=replace(resolved.workload, batch_size=batch)))
        if solution.fits:
            speeds[batch] = lone_speed(solution, problem, compute_dtype(lone))
    return speeds


def test_a_roomy_box_gets_every_slot_at_once():
    choice = choose_slots(SKELETON, _inputs("4GiB", disk=False), 32)
    assert choice.batch_size == 32 and "fit beside the weights" in choice.reason


def test_without_a_disk_the_most_slots_that_fit():
    inputs = _inputs("160MiB", disk=False)
    choice = choose_slots(SKELETON, inputs, 32)
    assert 1 <= choice.batch_size < 32
    plan_inputs(SKELETON, replace(inputs, batch_size=choice.batch_size))  # fits
    larger = min(b for b in (2, 4, 8, 16, 32) if b > choice.batch_size)
    try:
        plan_inputs(SKELETON, replace(inputs, batch_size=larger), advise=False)
        raise AssertionError(f"{larger} slots fit too, yet {choice.batch_size} were chosen")
    except PlanError:
        pass
    assert f"{larger} do not fit" in choice.reason


def test_with_a_disk_slots_stop_where_a_lone_stream_would_slow():
    inputs = _inputs("100MiB", disk=True)
    choice = choose_slots(SKELETON, inputs, 32)
    speeds = _lone_speeds(inputs)
    best = max(speeds.values())
    assert speeds[choice.batch_size] >= SPEED_FLOOR * best
    assert all(speeds[b] < SPEED_FLOOR * best for b in speeds if b > choice.batch_size)
    assert choice.batch_size < 32, "the box is too small for 32 slots without pushing layers to disk"


def test_nothing_fits_gives_the_floor_so_the_refusal_speaks_of_one_sequence():
    choice = choose_slots(SKELETON, _inputs("8MiB", disk=False), 32)
    assert choice.batch_size == 1 and "even one sequence" in choice.reason


def _lone_speeds_by_step(inputs: PlanInputs) -> dict[int, float]:
    from planner.placement.cost_model import compute_dtype
    from planner.placement.inputs import resolve_inputs
    from planner.placement.solve import make_problem, solve

    resolved = resolve_inputs(SKELETON, inputs)
    lone = replace(resolved.workload, batch_size=1)
    problem = make_problem(resolved.skeleton, resolved.hardware, lone)
    speeds = {}
    for chunk in (2048, 1024, 512, 256):
        solution = solve(replace(resolved, workload=replace(resolved.workload, prefill_chunk=chunk)))
        if solution.fits:
            speeds[chunk] = lone_speed(solution, problem, compute_dtype(lone))
    return speeds


def test_a_roomy_box_prefills_the_largest_step():
    choice = choose_step(SKELETON, _inputs("4GiB", disk=False))
    assert choice.prefill_chunk == PREFILL_CHUNK and "fit beside the weights" in choice.reason


def test_a_box_smaller_than_the_model_takes_a_smaller_step_that_keeps_weights_resident():
    inputs = _inputs("40MiB", disk=True)
    choice = choose_step(SKELETON, inputs)
    speeds = _lone_speeds_by_step(inputs)
    best = max(speeds.values())
    assert MIN_PREFILL_CHUNK <= choice.prefill_chunk < PREFILL_CHUNK, (choice, speeds)
    assert speeds[choice.prefill_chunk] >= SPEED_FLOOR * best
    assert all(speeds[c] < SPEED_FLOOR * best for c in speeds if c > choice.prefill_chunk)
    assert f"a step of {choice.prefill_chunk * 2}" in choice.reason
