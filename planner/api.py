"""``plan()``: the one entry point the CLI, the loader and the service call.

Planning is three stages, each its own module and each public, so what-if, estimate and advice reuse them:

1. resolve inputs (:mod:`planner.placement.inputs`): model -> Skeleton, limits -> Hardware, workload -> Workload;
2. solve (:mod:`planner.placement.solve`): size every block, run the strategy, retry without GPUs too small to compute on;
3. assemble (:mod:`planner.placement.assemble`): the Plan with its device map, budgets, predictions, reasons and warnings.

When nothing fits, :mod:`planner.placement.advice` turns the failed solution into a PlanError naming the shortfall and the
smallest changes that would fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from planner.errors import PlanError
from planner.placement.advice import explain_no_fit
from planner.placement.assemble import assemble
from planner.placement.cost_model import compute_dtype, predict
from planner.placement.inputs import PlanInputs, resolve_inputs
from planner.placement.solve import Solution, make_problem, solve
from planner.placement.strategies import Problem, compute_loads
from planner.types import Hardware, Plan


def plan(
    model: Any,
    max_memory: Mapping[Any, Any] | None = None,
    strategy: str | Mapping[str, Any] = "auto",
    dtype: str | None = None,
    quantization: str | None = None,
    batch_size: int = 1,
    context: int | None = None,
    gpus: str | list[Any] | None = None,
    *,
    offload_folder: str | os.PathLike | None = None,
    gpu_reserve: int | str | None = None,
    bandwidths: Mapping[str, float] | None = None,
    complete: bool = False,
    hardware: Hardware | None = None,
    advise: bool = True,
    cpu_quantization: str | None = None,
    prefill_chunk: int | None = None,
) -> Plan:
    """Plan where each block of ``model`` goes. See the package docstring for the accepted inputs.

    ``complete=True`` lets a custom map leave modules out for the planner to place. ``hardware`` skips
    resolution of ``max_memory``/``gpus`` (the caller built it). ``advise=False`` skips the search for changes
    that would fit when nothing does. ``cpu_quantization`` (``int8``/``int4``) sizes the linear layers in the
    native CPU formats the loader's ``cpu_quantization`` stores. ``prefill_chunk`` budgets activations for a
    forward of that many prompt tokens plus one decode row per sequence (the serving engine's
    :data:`~planner.types.PREFILL_CHUNK`); None, the default, for a whole-batch prefill as ``generate`` runs it.
    """
    inputs = PlanInputs(
        max_memory=max_memory,
        gpus=gpus,
        strategy=strategy,
        dtype=dtype,
        quantization=quantization,
        batch_size=batch_size,
        context=context,
        gpu_reserve=gpu_reserve,
        offload_folder=offload_folder,
        bandwidths=bandwidths,
        complete=complete,
        cpu_quantization=cpu_quantization,
        prefill_chunk=prefill_chunk,
    )
    return plan_inputs(model, inputs, hardware=hardware, advise=advise)


def plan_inputs(model: Any, inputs: PlanInputs, *, hardware: Hardware | None = None, advise: bool = True) -> Plan:
    """:func:`plan` for inputs already read into a :class:`~planner.placement.inputs.PlanInputs` (the CLI, settings, /plan)."""
    resolved = resolve_inputs(model, inputs, hardware)
    solution = solve(resolved)
    if not solution.fits:
        raise PlanError(explain_no_fit(resolved, solution, advise))
    return assemble(resolved.skeleton, solution, resolved.workload)


def fits(model: Any, **kwargs: Any) -> bool:
    """Whether ``plan(model, **kwargs)`` succeeds (no advice search)."""
    try:
        plan(model, advise=False, **kwargs)
        return True
    except PlanError:
        return False


__all__ = ["plan", "plan_inputs", "fits"]


#: Slots beyond one may cost a lone stream at most this fraction of its predicted speed: concurrency is taken where
#: it is nearly free, not bought with a single user's latency.
SLOT_SPEED_FLOOR = 0.9


@dataclass(frozen=True)
class SlotChoice:
    """How many sequences the server's KV cache holds at once (its slots), and why: what the plan budgets KV for."""

    batch_size: int
    reason: str


def lone_speed(solution: Solution, lone_problem: Problem, dtype: str | None) -> float:
    """Predicted tokens/s of one stream alone on ``solution``'s placement (made for more slots): the weights stay
    where that placement put them, the memory the other slots hold stays taken, only one sequence reads."""
    assignment = solution.fill.assignment
    assert assignment is not None, "a fitting solution has an assignment"
    loads = solution.fill.loads or compute_loads(solution.problem, assignment)
    lone = replace(lone_problem, excluded=solution.problem.excluded)
    return predict(lone, assignment, loads, 1, dtype).decode_tokens_per_s


def choose_slots(model: Any, inputs: PlanInputs, max_batch_size: int) -> SlotChoice:
    """The number of KV slots for a server that was not told a batch size: between one sequence of the full context
    (the floor: below it nothing is served) and ``max_batch_size`` of them.

    Beyond the floor, KV competes with resident weights: in a box smaller than the model each slot's KV pushes
    weights out (to disk, or off the GPUs) and slows every stream. So the most slots are taken whose placement still
    predicts a lone stream at least :data:`SLOT_SPEED_FLOOR` of the fastest lone stream any fitting placement gives.
    Where ``max_batch_size`` slots fit with nothing offloaded, that is the answer at once (one solve, the usual
    case). Where nothing fits even one slot, the answer is one slot, so that the refusal's advice speaks of the
    floor."""
    resolved = resolve_inputs(model, inputs)

    def solved(batch: int) -> Solution:
        return solve(replace(resolved, workload=replace(resolved.workload, batch_size=batch)))

    most = solved(max_batch_size)
    if most.fits and all(d not in ("cpu", "disk") or not resolved.hardware.gpus for d in most.fill.assignment):
        if "disk" not in most.fill.assignment:
            return SlotChoice(
                max_batch_size, f"{max_batch_size} KV slots (--max-batch-size): they fit beside the weights"
            )
    lone = replace(resolved.workload, batch_size=1)
    lone_problem = make_problem(resolved.skeleton, resolved.hardware, lone)
    candidates = sorted({max_batch_size, *(1 << i for i in range(max_batch_size.bit_length()))}, reverse=True)
    speed: dict[int, float] = {}
    for batch in (b for b in candidates if 1 <= b <= max_batch_size):
        solution = most if batch == max_batch_size else solved(batch)
        if solution.fits:
            speed[batch] = lone_speed(solution, lone_problem, compute_dtype(lone))
    if not speed:
        return SlotChoice(1, "no plan fits even one sequence of the full context")
    best = max(speed.values())
    batch = max(b for b, s in speed.items() if s >= SLOT_SPEED_FLOOR * best)
    slots = f"{batch} KV slot{'s' if batch > 1 else ''}"
    if batch == max_batch_size:
        return SlotChoice(batch, f"{slots} (--max-batch-size): they fit beside the weights")
    larger = min(b for b in candidates if b > batch)
    why = (
        f"{larger} do not fit"
        if larger not in speed
        else f"{larger} would push weights out of memory and slow a lone stream below {SLOT_SPEED_FLOOR:.0%} of its "
        f"predicted {best:.3g} tokens/s"
    )
    return SlotChoice(batch, f"{slots} of --max-batch-size {max_batch_size}: {why}; give --batch-size to plan for more")
