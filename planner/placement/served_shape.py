"""The shape of the work a server plans for when it was not told: how many sequences its KV cache holds at once
(its slots) and how many prompt tokens one engine step prefills at most (its step).

Both compete with resident weights. In a box smaller than the model every byte of KV or activations pushes a byte
of weights out to disk (or off the GPUs), and that byte is then read again for every token of every stream. So each
is taken as large as it can be while a lone stream keeps at least :data:`SPEED_FLOOR` of the fastest decode any
fitting choice gives; where everything fits resident, the largest at once (one solve, the usual case).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from planner.placement.cost_model import compute_dtype
from planner.placement.inputs import PlanInputs, ResolvedInputs, resolve_inputs
from planner.placement.solve import Solution, lone_speed, make_problem, solve
from planner.types import PREFILL_CHUNK, Workload

#: Slots beyond one, or a step beyond the smallest, may cost a lone stream at most this fraction of its predicted
#: speed: concurrency and prefill speed are taken where they are cheap, not bought with much of a user's latency.
#: 0.85, not 0.9, since the cost model overlaps a cold disk tier's reads with the CPU's work: each byte pushed to
#: disk then weighs more against the shorter step. The 1.03B fp32 in a 3 GiB box on a Zen 4 (2026-12-07) fell to
#: one slot at 0.9 (a second one predicted at 0.89x): one stream 1.94-2.18 tok/s, 16 clients 4.2-6.0; with two,
#: one stream 1.80-2.25 and 16 clients 12.7-15.1.
SPEED_FLOOR = 0.85
#: The smallest prefill step a tight box is planned for: below it a long prompt takes many reads of the offloaded
#: weights (one per step) for little memory.
MIN_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class SlotChoice:
    """How many sequences the server's KV cache holds at once (its slots), and why: what the plan budgets KV for."""

    batch_size: int
    reason: str


@dataclass(frozen=True)
class StepChoice:
    """The most prompt tokens one engine step prefills (the plan budgets activations for it), and why."""

    prefill_chunk: int
    reason: str


def _all_resident(solution: Solution, resolved: ResolvedInputs) -> bool:
    """Whether ``solution`` fits with nothing on disk, and nothing on the CPU where there are GPUs."""
    if not solution.fits:
        return False
    devices = set(solution.fill.assignment)
    return "disk" not in devices and not (resolved.hardware.gpus and "cpu" in devices)


def _speeds(resolved: ResolvedInputs, workloads: dict[int, Workload]) -> dict[int, float]:
    """A lone stream's predicted decode speed on the placement made for each candidate workload that fits."""
    lone = replace(resolved.workload, batch_size=1)  # speed: where the weights are, not how large a step is
    lone_problem = make_problem(resolved.skeleton, resolved.hardware, lone)
    speeds = {}
    for key, workload in workloads.items():
        solution = solve(replace(resolved, workload=workload))
        if solution.fits:
            speeds[key] = lone_speed(solution, lone_problem, compute_dtype(lone))
    return speeds


def _largest_near_best(speeds: dict[int, float]) -> int:
    best = max(speeds.values())
    return max(k for k, s in speeds.items() if s >= SPEED_FLOOR * best)


def choose_step(model: Any, inputs: PlanInputs) -> StepChoice:
    """The engine's prefill step for a server: :data:`PREFILL_CHUNK` where its activations fit beside resident
    weights, else the largest of ``PREFILL_CHUNK``, half of it, ... down to :data:`MIN_PREFILL_CHUNK` whose
    placement keeps a lone stream within :data:`SPEED_FLOOR` of the fastest (a 2048-token step of a 1B fp32 Llama
    holds 300 MiB of activations: in a 3 GiB box, 300 MiB more of its weights read from disk per token)."""
    resolved = resolve_inputs(model, replace(inputs, prefill_chunk=PREFILL_CHUNK))
    if _all_resident(solve(resolved), resolved):
        return StepChoice(
            PREFILL_CHUNK, f"prefill steps of {PREFILL_CHUNK} tokens: their activations fit beside the weights"
        )
    candidates = {}
    chunk = PREFILL_CHUNK
    while chunk >= MIN_PREFILL_CHUNK:
        candidates[chunk] = replace(resolved.workload, prefill_chunk=chunk)
        chunk //= 2
    speeds = _speeds(resolved, candidates)
    if not speeds:
        return StepChoice(MIN_PREFILL_CHUNK, "no plan fits even the smallest prefill step")
    step = _largest_near_best(speeds)
    why = (
        "the largest step"
        if step == PREFILL_CHUNK
        else f"a step of {step * 2} would push weights out of memory and slow a lone stream below "
        f"{SPEED_FLOOR:.0%} of its predicted {max(speeds.values()):.3g} tokens/s"
    )
    return StepChoice(step, f"prefill steps of {step} tokens: {why}")


def choose_slots(model: Any, inputs: PlanInputs, max_batch_size: int) -> SlotChoice:
    """The number of KV slots for a server that was not told a batch size: between one sequence of the full context
    (the floor: below it nothing is served) and ``max_batch_size`` of them, the most whose placement keeps a lone
    stream within :data:`SPEED_FLOOR` of the fastest. Where nothing fits even one slot, the answer is one slot, so
    that the refusal's advice speaks of the floor."""
    resolved = resolve_inputs(model, inputs)
    most = replace(resolved.workload, batch_size=max_batch_size)
    if _all_resident(solve(replace(resolved, workload=most)), resolved):
        return SlotChoice(max_batch_size, f"{max_batch_size} KV slots (--max-batch-size): they fit beside the weights")
    candidates = sorted({max_batch_size, *(1 << i for i in range(max_batch_size.bit_length()))}, reverse=True)
    speeds = _speeds(
        resolved, {b: replace(resolved.workload, batch_size=b) for b in candidates if 1 <= b <= max_batch_size}
    )
    if not speeds:
        return SlotChoice(1, "no plan fits even one sequence of the full context")
    batch = _largest_near_best(speeds)
    slots = f"{batch} KV slot{'s' if batch > 1 else ''}"
    if batch == max_batch_size:
        return SlotChoice(batch, f"{slots} (--max-batch-size): they fit beside the weights")
    larger = min(b for b in candidates if b > batch)
    why = (
        f"{larger} do not fit"
        if larger not in speeds
        else f"{larger} would push weights out of memory and slow a lone stream below {SPEED_FLOOR:.0%} of its "
        f"predicted {max(speeds.values()):.3g} tokens/s"
    )
    return SlotChoice(batch, f"{slots} of --max-batch-size {max_batch_size}: {why}; give --batch-size to plan for more")
