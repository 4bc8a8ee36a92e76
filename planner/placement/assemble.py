"""The planner's last stage: a solution that fits, written up as the Plan users and the loader read.

The device map is merged to the shortest prefixes (transformers' ``hf_device_map`` format); each device gets its
budget (weights, KV cache, activations, reserve); the cost model's predictions, one reason per run of blocks and the
warnings a user should see are attached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.hardware.devices import device_label
from planner.hardware.units import format_bytes
from planner.model.moe import unquantized_experts_warning
from planner.placement.cost_model import compute_dtype, predict
from planner.placement.hf_device_map import merge_device_map
from planner.placement.sizing import kv_explanation, tensor_bytes
from planner.placement.solve import Solution
from planner.placement.strategies import Problem, compute_loads
from planner.types import DeviceBudget, DeviceId, Plan, Skeleton, Workload


@dataclass(frozen=True)
class Run:
    """Consecutive blocks ``first..last`` (indices) placed on one device."""

    device: DeviceId
    first: int
    last: int


def runs_of(assignment: list[DeviceId]) -> list[Run]:
    runs: list[Run] = []
    for i, dev in enumerate(assignment):
        if runs and runs[-1].device == dev and runs[-1].last == i - 1:
            runs[-1] = replace(runs[-1], last=i)
        else:
            runs.append(Run(dev, i, i))
    return runs


def _device_map(skeleton: Skeleton, problem: Problem, placement: dict[str, DeviceId]) -> dict[str, DeviceId]:
    """The merged device map of the blocks, plus a nested entry for each item split off a block (a MoE layer's
    routed experts) that lives elsewhere than the rest of its block: transformers' most-specific-key rule."""
    blocks = {b.name for b in skeleton.blocks}
    merged = merge_device_map(skeleton, {n: d for n, d in placement.items() if n in blocks})
    for it in problem.items:
        if it.name not in blocks and placement[it.name] != placement[skeleton.blocks[it.block].name]:
            merged[it.name] = placement[it.name]
    return merged


def assemble(skeleton: Skeleton, solution: Solution, workload: Workload) -> Plan:
    """The Plan of a solution that fits: merged device map, per-device budgets, predictions, reasons, warnings."""
    problem, assignment, strategy_name = solution.problem, solution.fill.assignment, solution.strategy
    if assignment is None:
        raise ValueError("assemble() needs a solution that fits; explain the others with planner.placement.advice")
    hw = problem.hardware
    loads = solution.fill.loads or compute_loads(problem, assignment)
    names = [it.name for it in problem.items]  # the skeleton's blocks, MoE layers' routed experts split off
    placement = dict(zip(names, assignment))
    budgets = []
    for d in hw.devices:
        budgets.append(
            DeviceBudget(
                device=d.id,
                capacity=d.capacity,
                weights=loads.weights.get(d.id, 0),
                kv_cache=loads.kv.get(d.id, 0),
                activations=loads.activations.get(d.id, 0),
                reserve=loads.reserve.get(d.id, 0),
                blocks=[n for n, dev in zip(names, assignment) if dev == d.id],
            )
        )
    prediction = predict(problem, assignment, loads, workload.batch_size, compute_dtype(workload))
    streamed = [problem.item_runs_on(i, dev) != dev for i, dev in enumerate(assignment)]
    offloaded = sum(it.weight for it, s in zip(problem.items, streamed) if s)
    reasons = list(hw.notes) + list(solution.reasons)
    kv_note = kv_explanation(skeleton, workload)
    if kv_note:
        reasons.append(kv_note)
    on_host = [i for i, it in enumerate(problem.items) if it.in_place and assignment[i] == "cpu"]
    in_place = [i for i in on_host if not problem.items[i].is_layer and problem.items[i].expert_weight]
    if in_place:  # routed experts split off their layers: one line for all, the layers' runs read as if whole
        n_exp = len(in_place)
        span = names[in_place[0]] if n_exp == 1 else f"{names[in_place[0]]} .. {names[in_place[-1]]} ({n_exp} blocks)"
        reasons.append(
            f"cpu <- routed experts {span} (computed on the CPU, reading only the experts each step routes to)"
        )
    kept = [i for i in range(len(assignment)) if i not in set(in_place)]
    for kept_run in runs_of([assignment[i] for i in kept]):
        run = Run(kept_run.device, kept[kept_run.first], kept[kept_run.last])
        dev, first = run.device, names[run.first]
        n = kept_run.last - kept_run.first + 1
        span = first if n == 1 else f"{first} .. {names[run.last]} ({n} blocks)"
        cap = hw.get(dev).capacity  # type: ignore[union-attr]
        util = f", {loads.total(dev) / cap:.0%} of {format_bytes(cap)}" if cap else ""
        why = ""
        anchor = problem.computes_with.get(run.first)
        if anchor is not None and assignment[run.first] == assignment[anchor]:
            why = f" (computed once per forward for every layer: placed with {names[anchor]})"
        elif run.first in problem.follows:
            why = f" (tied to {names[problem.follows[run.first]]})"
        elif problem.items[run.first].is_embedding and run.first in problem.pinned and "_on_cpu" in strategy_name:
            why = (
                " (input embeddings: decode reads one row per token, so they are offloaded first and looked up on the"
                " host; the rows, not the table, cross to the GPU)"
            )
        elif run.first in problem.pinned:
            why = " (as the custom map says)"
        elif run.first in on_host:
            why = " (computed on the CPU where it lives, KV cache too: did not fit the GPUs, and not streamed)"
        elif streamed[run.first]:
            why = " (offloaded: did not fit on faster devices)"
        reasons.append(f"{device_label(dev)} <- {span}{why}{util}")
    warnings = []
    if offloaded:
        where = sorted({device_label(dev) for dev, s in zip(assignment, streamed) if s})
        warnings.append(
            f"{format_bytes(offloaded)} of weights offloaded to {', '.join(where)}; they are streamed to "
            f"{device_label(problem.computes_on('cpu'))} for every token, which bounds decode speed"
        )
    experts_note = unquantized_experts_warning(skeleton, workload, lambda t: tensor_bytes(t, workload))
    if experts_note:
        warnings.append(experts_note)
    for d in hw.gpus:
        if d.id not in set(assignment):
            warnings.append(f"{device_label(d.id)} holds nothing under this plan")
    if strategy_name.endswith("balanced_low_0") and len(hw.gpus) < 2:
        warnings.append("balanced_low_0 needs at least two GPUs; with fewer it is the same as balanced")
    for i, anchor in problem.follows.items():
        if i > 0 and assignment[i] != assignment[i - 1]:
            warnings.append(
                f"{names[i]} shares weights with {names[anchor]} and runs on "
                f"{device_label(assignment[i])}: one extra device hop per token"
            )
    device_map = _device_map(skeleton, problem, placement)
    cpu_compute = [names[i] for i in on_host]
    for name in cpu_compute:  # each one its own key, so that the loader can tell it from a streamed neighbour
        device_map.setdefault(name, "cpu")
    return Plan(
        model=skeleton.name,
        architecture=skeleton.architecture,
        strategy=strategy_name,
        workload=workload,
        device_map=device_map,
        budgets=budgets,
        offloaded_bytes=offloaded,
        prediction=prediction,
        warnings=warnings,
        reasons=reasons,
        placement=placement,
        fingerprint=skeleton.fingerprint,
        revision=skeleton.revision,
        cpu_compute=cpu_compute,
    )
