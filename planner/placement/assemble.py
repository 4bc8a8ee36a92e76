"""The planner's last stage: a solution that fits, written up as the Plan users and the loader read.

The device map is merged to the shortest prefixes (transformers' ``hf_device_map`` format); each device gets its
budget (weights, KV cache, activations, reserve); the cost model's predictions, one reason per run of blocks and the
warnings a user should see are attached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.hardware.devices import device_label
from planner.hardware.units import format_bytes
from planner.model.moe import moe_layers, sparse_read, unquantized_experts_warning
from planner.placement.cost_model import CONCURRENCY, CONCURRENT_CONTEXT, compute_dtype, extra_row_cost, predict
from planner.placement.draft_budget import held_for_draft
from planner.placement.hf_device_map import merge_device_map
from planner.placement.sizing import kv_explanation, tensor_bytes
from planner.placement.solve import Solution, lone_speed, make_problem
from planner.placement.speculative_rate import DEFAULT_ACCEPTANCE, speculative_tokens_per_s
from planner.placement.strategies import Loads, Problem, compute_loads
from planner.placement.tier_kernels import tier_kernels
from planner.types import (
    ConcurrentRate,
    DeviceBudget,
    DeviceId,
    DraftBudget,
    Hardware,
    Plan,
    Prediction,
    Skeleton,
    Workload,
)


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


@dataclass(frozen=True)
class _Placed:
    """A solution that fits, with the facts about it that the budgets, the reasons and the warnings all read, worked
    out once: the loads per device, which items are streamed from where they live to where they compute, and which
    the CPU computes where they live (``on_host``; of those, ``split_experts`` are routed experts split off their
    layers, reported together in one line)."""

    problem: Problem
    assignment: list[DeviceId]
    strategy: str
    names: list[str]  # the skeleton's blocks, MoE layers' routed experts split off
    loads: Loads
    streamed: list[bool]
    on_host: list[int]
    split_experts: list[int]


def _placed(solution: Solution) -> _Placed:
    problem, assignment = solution.problem, solution.fill.assignment
    if assignment is None:
        raise ValueError("assemble() needs a solution that fits; explain the others with planner.placement.advice")
    on_host = [i for i, it in enumerate(problem.items) if it.in_place and assignment[i] == "cpu"]
    return _Placed(
        problem=problem,
        assignment=assignment,
        strategy=solution.strategy,
        names=[it.name for it in problem.items],
        loads=solution.fill.loads or compute_loads(problem, assignment),
        streamed=[problem.item_runs_on(i, dev) != dev for i, dev in enumerate(assignment)],
        on_host=on_host,
        split_experts=[i for i in on_host if not problem.items[i].is_layer and problem.items[i].expert_weight],
    )


def with_speculation(prediction: Prediction, draft: DraftBudget, hardware: Hardware) -> Prediction:
    """``prediction`` with one stream's speculative rate: its lone step as the verify pass, each draft token the
    draft's resident weights over its device's memory rate, at the stated default acceptance."""
    device = next((d for d in hardware.devices if d.id == draft.device), None)
    if device is None or not prediction.lone_decode_tokens_per_s:
        return prediction
    rate = speculative_tokens_per_s(
        1.0 / prediction.lone_decode_tokens_per_s, draft.weights / device.bandwidth, draft.tokens
    )
    return replace(prediction, speculative_tokens_per_s=round(rate, 4), speculative_acceptance=DEFAULT_ACCEPTANCE)


def _concurrent_rates(
    skeleton: Skeleton, placed: _Placed, workload: Workload, dtype: str | None, row_cost: float
) -> list[ConcurrentRate]:
    """The aggregate decode rate of each of :data:`CONCURRENCY` sequences of :data:`CONCURRENT_CONTEXT` tokens on the
    placement: the problem's KV cache (sized for the workload's batch and context) scaled to what they hold, and
    each MoE layer's routed experts read as that many sequences touch them (:func:`_experts_read_at`)."""
    pool_tokens = workload.batch_size * workload.context
    rates = []
    for n in CONCURRENCY:
        kv_scale = n * min(CONCURRENT_CONTEXT, workload.context) / pool_tokens
        problem = _experts_read_at(skeleton, placed.problem, workload.batch_size, n)
        p = predict(problem, placed.assignment, placed.loads, n, dtype, row_cost, kv_scale)
        rates.append(ConcurrentRate(n, p.decode_tokens_per_s))
    return rates


def _experts_read_at(skeleton: Skeleton, problem: Problem, sized_for: int, batch: int) -> Problem:
    """``problem`` with each item's routed experts read as ``batch`` sequences touch them, not ``sized_for``:
    ``E*(1-(1-k/E)^B)`` of ``E`` (16 sequences touch 88% of gpt-oss's 32 experts where one touches 4)."""
    layers = {m.layer: m for m in moe_layers(skeleton)}
    if not layers or batch == sized_for:
        return problem
    items = []
    for item in problem.items:
        layer = layers.get(skeleton.blocks[item.block].name) if item.expert_weight and item.block >= 0 else None
        if layer is not None:
            read = item.read_per_token - sparse_read(item.expert_weight, layer, sized_for)
            item = replace(item, read_per_token=read + sparse_read(item.expert_weight, layer, batch))
        items.append(item)
    return replace(problem, items=tuple(items))


def assemble(skeleton: Skeleton, solution: Solution, workload: Workload) -> Plan:
    """The Plan of a solution that fits: merged device map, per-device budgets, predictions, reasons, warnings."""
    placed = _placed(solution)
    problem, assignment, names = placed.problem, placed.assignment, placed.names
    placement = dict(zip(names, assignment))
    dtype, row_cost = compute_dtype(workload), extra_row_cost(workload)
    prediction = predict(problem, assignment, placed.loads, workload.batch_size, dtype, row_cost)
    concurrent = _concurrent_rates(skeleton, placed, workload, dtype, row_cost)
    lone = prediction.decode_tokens_per_s
    if workload.batch_size > 1:
        lone_problem = make_problem(skeleton, problem.hardware, replace(workload, batch_size=1))
        lone = round(lone_speed(solution, lone_problem, dtype), 4)
    prediction = replace(prediction, lone_decode_tokens_per_s=lone, concurrent=concurrent)
    if workload.draft is not None and lone:
        prediction = with_speculation(prediction, workload.draft, problem.hardware)
    offloaded = sum(it.weight for it, s in zip(problem.items, placed.streamed) if s)
    device_map = _device_map(skeleton, problem, placement)
    cpu_compute = [names[i] for i in placed.on_host]
    for name in cpu_compute:  # each one its own key, so that the loader can tell it from a streamed neighbour
        device_map.setdefault(name, "cpu")
    return Plan(
        model=skeleton.name,
        architecture=skeleton.architecture,
        strategy=placed.strategy,
        workload=workload,
        device_map=device_map,
        budgets=_budgets(placed),
        offloaded_bytes=offloaded,
        prediction=prediction,
        warnings=_warnings(skeleton, workload, placed, offloaded),
        reasons=_reasons(skeleton, workload, placed, solution.reasons),
        placement=placement,
        fingerprint=skeleton.fingerprint,
        revision=skeleton.revision,
        cpu_compute=cpu_compute,
        kernels=tier_kernels(skeleton, workload, _in_plan_order(problem, assignment), bool(cpu_compute)),
    )


def _in_plan_order(problem: Problem, assignment: list[DeviceId]) -> list[DeviceId]:
    """The devices that hold blocks, in the hardware's order (GPUs, cpu, disk)."""
    held = set(assignment)
    return [d.id for d in problem.hardware.devices if d.id in held]


def _budgets(placed: _Placed) -> list[DeviceBudget]:
    """Each device's planned bytes by kind, against its capacity, and the blocks it holds."""
    budgets = []
    hardware = placed.problem.hardware
    for d in hardware.devices:
        draft = held_for_draft(hardware, d.id)  # taken off the capacity the blocks were placed in: given back here
        budgets.append(
            DeviceBudget(
                device=d.id,
                capacity=d.capacity + draft,
                weights=placed.loads.weights.get(d.id, 0),
                kv_cache=placed.loads.kv.get(d.id, 0),
                activations=placed.loads.activations.get(d.id, 0),
                reserve=placed.loads.reserve.get(d.id, 0),
                blocks=[n for n, dev in zip(placed.names, placed.assignment) if dev == d.id],
                draft=draft,
            )
        )
    return budgets


def _reasons(skeleton: Skeleton, workload: Workload, placed: _Placed, solver_reasons: tuple[str, ...]) -> list[str]:
    """The hardware's notes, why the strategy was chosen, how the KV cache was sized, then one line per run of
    blocks on one device (``device <- first .. last``, with why and how full the device is). Routed experts split
    off their layers get one line for all of them, so the layers' runs read as if whole."""
    names, assignment = placed.names, placed.assignment
    reasons = list(placed.problem.hardware.notes) + list(solver_reasons)
    kv_note = kv_explanation(skeleton, workload)
    if kv_note:
        reasons.append(kv_note)
    experts = placed.split_experts
    if experts:
        n_exp = len(experts)
        span = names[experts[0]] if n_exp == 1 else f"{names[experts[0]]} .. {names[experts[-1]]} ({n_exp} blocks)"
        reasons.append(
            f"cpu <- routed experts {span} (computed on the CPU, reading only the experts each step routes to)"
        )
    split_off = set(experts)
    kept = [i for i in range(len(assignment)) if i not in split_off]
    for kept_run in runs_of([assignment[i] for i in kept]):
        run = Run(kept_run.device, kept[kept_run.first], kept[kept_run.last])
        dev, first = run.device, names[run.first]
        n = kept_run.last - kept_run.first + 1
        span = first if n == 1 else f"{first} .. {names[run.last]} ({n} blocks)"
        cap = placed.problem.hardware.get(dev).capacity  # type: ignore[union-attr]
        util = f", {placed.loads.total(dev) / cap:.0%} of {format_bytes(cap)}" if cap else ""
        reasons.append(f"{device_label(dev)} <- {span}{_why_there(placed, run.first)}{util}")
    return reasons


def _why_there(placed: _Placed, first: int) -> str:
    """Why a run starting at item ``first`` is where it is, when something other than "it fit there" decided: the
    item it computes with, a tie, the embeddings offloaded first, a custom map, host compute or offloading."""
    problem, assignment, names = placed.problem, placed.assignment, placed.names
    anchor = problem.computes_with.get(first)
    if anchor is not None and assignment[first] == assignment[anchor]:
        return f" (computed once per forward for every layer: placed with {names[anchor]})"
    if first in problem.follows:
        return f" (tied to {names[problem.follows[first]]})"
    if problem.items[first].is_embedding and first in problem.pinned and "_on_cpu" in placed.strategy:
        return (
            " (input embeddings: decode reads one row per token, so they are offloaded first and looked up on the"
            " host; the rows, not the table, cross to the GPU)"
        )
    if first in problem.pinned:
        return " (as the custom map says)"
    if first in placed.on_host:
        return " (computed on the CPU where it lives, KV cache too: did not fit the GPUs, and not streamed)"
    if placed.streamed[first]:
        return " (offloaded: did not fit on faster devices)"
    return ""


def _warnings(skeleton: Skeleton, workload: Workload, placed: _Placed, offloaded: int) -> list[str]:
    """What a user should know before running the plan: streamed weights bound decode speed, unquantized experts,
    idle GPUs, a strategy that needs more GPUs than there are, and tied weights split across devices."""
    problem, assignment, names, hw = placed.problem, placed.assignment, placed.names, placed.problem.hardware
    warnings = []
    if offloaded:
        where = sorted({device_label(dev) for dev, s in zip(assignment, placed.streamed) if s})
        warnings.append(
            f"{format_bytes(offloaded)} of weights offloaded to {', '.join(where)}; they are streamed to "
            f"{device_label(problem.computes_on('cpu'))} for every token, which bounds decode speed"
        )
    experts_note = unquantized_experts_warning(skeleton, workload, lambda t: tensor_bytes(t, workload))
    if experts_note:
        warnings.append(experts_note)
    used = set(assignment)
    for d in hw.gpus:
        if d.id not in used:
            warnings.append(f"{device_label(d.id)} holds nothing under this plan")
    if placed.strategy.endswith("balanced_low_0") and len(hw.gpus) < 2:
        warnings.append("balanced_low_0 needs at least two GPUs; with fewer it is the same as balanced")
    for i, anchor in problem.follows.items():
        if i > 0 and assignment[i] != assignment[i - 1]:
            warnings.append(
                f"{names[i]} shares weights with {names[anchor]} and runs on "
                f"{device_label(assignment[i])}: one extra device hop per token"
            )
    return warnings
