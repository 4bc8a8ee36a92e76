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
from dataclasses import replace
from typing import Any

from planner.errors import PlanError
from planner.placement.advice import explain_no_fit
from planner.placement.assemble import assemble
from planner.placement.draft_budget import draft_cost_reason
from planner.placement.inputs import PlanInputs, ResolvedInputs, resolve_inputs
from planner.placement.solve import solve
from planner.placement.strategies import compute_loads
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
    the_plan = assemble(resolved.skeleton, solution, resolved.workload)
    if resolved.workload.draft is not None:
        the_plan.reasons.append(_draft_cost(resolved, the_plan))
    return the_plan


def _draft_cost(resolved: ResolvedInputs, the_plan: Plan) -> str:
    """What the draft model costs the target's residency: the target planned again without it (it fits, with more
    room), and its weights per device compared."""
    workload = resolved.workload
    assert workload.draft is not None
    alone = solve(replace(resolved, workload=replace(workload, draft=None)))
    assignment = alone.fill.assignment
    without = {} if assignment is None else (alone.fill.loads or compute_loads(alone.problem, assignment)).weights
    with_draft = {b.device: b.weights for b in the_plan.budgets}
    return draft_cost_reason(workload.draft, workload, with_draft, without)


def fits(model: Any, **kwargs: Any) -> bool:
    """Whether ``plan(model, **kwargs)`` succeeds (no advice search)."""
    try:
        plan(model, advise=False, **kwargs)
        return True
    except PlanError:
        return False


__all__ = ["plan", "plan_inputs", "fits"]
