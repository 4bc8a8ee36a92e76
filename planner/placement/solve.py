"""The planner's second stage: from resolved inputs to a placement, or to the failure the advice explains.

:func:`solve` sizes every block for the workload (a :class:`~planner.placement.strategies.Problem`), runs the chosen strategy
(``auto`` scores its candidates with the cost model), and retries without GPUs too small to compute on. It returns a
:class:`Solution` whether or not everything fit; :func:`planner.placement.assemble.assemble` turns a fitting one into a Plan
and :mod:`planner.placement.advice` explains one that does not. :func:`fits` is the yes/no the advice's searches ask.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from planner.errors import PlanError
from planner.hardware.devices import device_label, is_gpu
from planner.model.decode_path import runs_module_forward
from planner.model.moe import moe_layers
from planner.placement.cost_model import compute_dtype, extra_row_cost, predict
from planner.placement.draft_budget import reserve_draft
from planner.placement.hf_device_map import resolve_custom_map
from planner.placement.inputs import ResolvedInputs, Strategy
from planner.placement.interleave import interleave_streamed
from planner.placement.sizing import activation_bytes, logits_bytes, size_blocks
from planner.placement.strategies import STRATEGIES, FillResult, Problem, compute_loads, sequential
from planner.placement.sub_layer import experts_on_cpu_candidates, experts_on_cpu_reason
from planner.types import DeviceId, Hardware, Skeleton, Workload

STRATEGY_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")
#: ``auto`` treats candidates within this fraction of the best predicted tokens/s as equally fast.
_NEAR_BEST = 0.99


@dataclass(frozen=True)
class Solution:
    """One solved problem: the fill (``fill.assignment`` is None when nothing fit), the strategy that made it and
    why it was chosen."""

    problem: Problem
    fill: FillResult
    strategy: str
    reasons: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.fill.assignment is not None


@dataclass(frozen=True)
class Candidate:
    """One feasible placement ``auto`` considered, with the figures it was compared on."""

    name: str
    problem: Problem
    fill: FillResult
    tokens_per_s: float
    peak_gpu_use: float
    hops: int

    def summary(self) -> str:
        return f"{self.tokens_per_s:.3g} tok/s, peak GPU use {self.peak_gpu_use:.0%}, {self.hops} hops"


def tied_follows(skeleton: Skeleton) -> dict[int, int]:
    """Block index -> index of the earlier block it must share a device with (tied weights)."""
    index = {b.name: i for i, b in enumerate(skeleton.blocks)}
    owner = skeleton.block_of_tensor()

    def block_index(tensor: str) -> int | None:
        if tensor in owner:
            return index[owner[tensor]]
        module = tensor.rsplit(".", 1)[0] if "." in tensor else ""
        return index.get(module)

    follows: dict[int, int] = {}
    for group in skeleton.tied_groups:
        members = sorted({i for i in (block_index(t) for t in group) if i is not None})
        for m in members[1:]:
            follows[m] = members[0]
    return follows


def is_computed_block(block) -> bool:
    """A block that holds only non-persistent buffers (a rotary embedding's ``inv_freq``): computed, not loaded."""
    return (
        bool(block.tensors)
        and block.layer_index is None
        and not block.is_head
        and not block.is_embedding
        and all(t.kind == "buffer_nonpersistent" for t in block.tensors)
    )


def computed_companions(skeleton: Skeleton) -> dict[int, int]:
    """Computed blocks -> the first decoder layer, whose computing device they should share. The rotary embedding is
    registered last, so a sequential fill put it on the last GPU, yet it runs once per forward before the first
    layer and its cos/sin are handed to every layer: computed with the first layer, they cross no device boundary
    until the layers do."""
    first = next((i for i, b in enumerate(skeleton.blocks) if b.layer_index is not None), None)
    if first is None:
        return {}
    return {i: first for i, b in enumerate(skeleton.blocks) if i > first and is_computed_block(b)}


def lone_speed(solution: Solution, lone_problem: Problem, dtype: str | None) -> float:
    """Predicted tokens/s of one stream alone on ``solution``'s placement (made for more slots or a larger step):
    the weights stay where that placement put them, the memory it reserved stays taken, only one sequence reads."""
    assignment = solution.fill.assignment
    assert assignment is not None, "a fitting solution has an assignment"
    loads = solution.fill.loads or compute_loads(solution.problem, assignment)
    lone = replace(lone_problem, excluded=solution.problem.excluded)
    return predict(lone, assignment, loads, 1, dtype).decode_tokens_per_s


def make_problem(
    skeleton: Skeleton, hardware: Hardware, workload: Workload, pinned: Mapping[int, DeviceId] | None = None
) -> Problem:
    """Every block sized for the workload, on this hardware less what the workload's draft model holds there
    (:func:`~planner.placement.draft_budget.reserve_draft`): what the strategies fill."""
    pinned = dict(pinned or {})
    hardware = reserve_draft(hardware, workload)
    follows = tied_follows(skeleton)
    companions = {i: j for i, j in computed_companions(skeleton).items() if i not in pinned and i not in follows}
    return Problem(
        items=tuple(size_blocks(skeleton, workload)),
        hardware=hardware,
        activation=activation_bytes(skeleton, workload),
        logits=logits_bytes(skeleton, workload),
        follows=follows,
        pinned=pinned,
        computes_with=companions,
        module_forward=runs_module_forward(skeleton),
    )


def fallbacks(problem: Problem) -> Iterator[Problem]:
    """The problem as asked; then without the GPUs too small to hold a GPU's compute buffers; then computing on the
    largest GPU (the ones before it left out); then without GPUs. A GPU too small to compute on should be skipped,
    not fail the plan. At most four attempts, however many GPUs there are."""
    yield problem
    gpus = problem.hardware.gpus
    if not gpus:
        return
    floor = problem.activation + problem.hardware.gpu_reserve
    tried: set[frozenset] = {frozenset()}
    small = frozenset(d.id for d in gpus if d.capacity < floor)
    largest = max(range(len(gpus)), key=lambda i: (gpus[i].capacity, -i))
    for excluded in (small, frozenset(d.id for d in gpus[:largest]) | small, frozenset(d.id for d in gpus)):
        if excluded not in tried:
            tried.add(excluded)
            yield replace(problem, excluded=excluded)


def _peak_gpu_use(problem: Problem, assignment: list[DeviceId]) -> float:
    loads = compute_loads(problem, assignment)
    utils = [loads.total(d.id) / d.capacity for d in problem.hardware.gpus if d.capacity > 0]
    return max(utils) if utils else 0.0


def _hops(assignment: list[DeviceId], skeleton: Skeleton) -> int:
    """Device changes along the blocks in execution order (computed blocks run with the layer they follow)."""
    order = [d for d, b in zip(assignment, skeleton.blocks) if not is_computed_block(b)]
    return sum(1 for a, b in zip(order, order[1:]) if a != b)


def _embedding_pins(skeleton: Skeleton, problem: Problem, device: DeviceId) -> dict[int, DeviceId]:
    """Input embeddings on ``device``, the next tier down: decode reads one row of them per sequence, so offloading
    them first costs almost nothing and frees their whole size for layers on the faster tier (``cpu`` under GPUs;
    ``disk`` under the CPU, where the rows are read from the shard's map and nothing else of the table)."""
    pins: dict[int, DeviceId] = {}
    tied = set(problem.follows) | set(problem.follows.values())
    for i, b in enumerate(skeleton.blocks):
        if b.is_embedding and not b.is_head and i not in tied:
            pins[i] = device
    return pins


def _embedding_candidates(
    skeleton: Skeleton, problem: Problem, seq: FillResult
) -> list[tuple[str, Problem, FillResult]]:
    """The embeddings-first offload candidates: to the CPU when layers spill off the GPUs, to disk when layers
    spill off the CPU of a host without GPUs."""
    spilled = seq.assignment is not None and not all(map(is_gpu, seq.assignment))
    if problem.gpus and problem.hardware.get("cpu") and spilled:
        tier: DeviceId = "cpu"
    elif not problem.gpus and problem.hardware.get("disk") and seq.assignment and "disk" in seq.assignment:
        tier = "disk"
    else:
        return []
    pins = _embedding_pins(skeleton, problem, tier)
    if not pins:
        return []
    pinned_problem = replace(problem, pinned={**problem.pinned, **pins})
    out = [(f"sequential+embeddings_on_{tier}", pinned_problem, sequential(pinned_problem))]
    if tier == "disk" and moe_layers(skeleton):
        out += _head_in_ram_candidate(skeleton, problem, pins, out[0][2])
    return out


def _head_in_ram_candidate(
    skeleton: Skeleton, problem: Problem, pins: dict[int, DeviceId], seq: FillResult
) -> list[tuple[str, Problem, FillResult]]:
    """A MoE model spilling to disk on a host without GPUs: its disk layers read only their touched experts
    (:mod:`loaders.run.expert_reads`), the head all of itself every step. So keep the head in RAM and send the
    fewest last layers to disk that make room for it."""
    if seq.assignment is None:
        return []
    heads = [i for i, b in enumerate(skeleton.blocks) if b.is_head and seq.assignment[i] == "disk"]
    layers = [i for i, b in enumerate(skeleton.blocks) if b.layer_index is not None]
    if not heads:
        return []
    first = sum(1 for i in layers if seq.assignment[i] == "disk") + 1
    for m in range(first, len(layers) + 1):
        pinned = {**problem.pinned, **pins, **{i: "disk" for i in layers[-m:]}, **{h: "cpu" for h in heads}}
        candidate = replace(problem, pinned=pinned)
        result = sequential(candidate)
        if result.assignment is not None:
            return [("sequential+embeddings_on_disk+head_in_ram", candidate, result)]
    return []


def _solve_custom(inputs: ResolvedInputs, device_map: Mapping[str, DeviceId]) -> Solution:
    skeleton, hardware = inputs.skeleton, inputs.hardware
    placement = resolve_custom_map(skeleton, device_map, complete=inputs.complete)
    index = {b.name: i for i, b in enumerate(skeleton.blocks)}
    pinned = {index[name]: dev for name, dev in placement.items()}
    for dev in set(pinned.values()):
        if hardware.get(dev) is None:
            raise PlanError(
                f"device map places modules on {device_label(dev)}, which is not among the planned devices "
                f"({', '.join(device_label(d.id) for d in hardware.devices)}); add it to max_memory or --gpus"
            )
    problem = make_problem(skeleton, hardware, inputs.workload, pinned)
    completed = inputs.complete and len(pinned) < len(skeleton.blocks)
    reason = "custom device map" + (", completed by the planner (sequential fill)" if completed else "")
    return Solution(problem, sequential(problem), "custom", (reason,))


def _auto(skeleton: Skeleton, problem: Problem, workload: Workload) -> Solution:
    """Score sequential, balanced and (when layers spill to a slower tier) embeddings-first offload by predicted
    tokens/s; among those within 1% of the best, the least peak GPU use, then the fewest hops."""
    tried: list[tuple[str, Problem, FillResult]] = [
        (name, problem, STRATEGIES[name](problem)) for name in ("sequential", "balanced")
    ]  # on ties sequential wins: fewer hops for the same headroom
    seq = tried[0][2]
    tried += _embedding_candidates(skeleton, problem, seq)
    if (
        problem.gpus
        and problem.hardware.get("cpu")
        and (seq.assignment is None or not all(map(is_gpu, seq.assignment)))
    ):
        tried += experts_on_cpu_candidates(skeleton, problem)
    candidates: list[Candidate] = []
    dtype, row_cost = compute_dtype(workload), extra_row_cost(workload)
    for name, p, r in tried:
        if r.assignment is None:
            continue
        r.loads = r.loads or compute_loads(p, r.assignment)
        tps = predict(p, r.assignment, r.loads, workload.batch_size, dtype, row_cost).decode_tokens_per_s
        candidates.append(Candidate(name, p, r, tps, _peak_gpu_use(p, r.assignment), _hops(r.assignment, skeleton)))
    if not candidates:
        return Solution(problem, seq, "auto")
    best_tps = max(c.tokens_per_s for c in candidates)
    near = sorted(
        (c for c in candidates if c.tokens_per_s >= best_tps * _NEAR_BEST), key=lambda c: (c.peak_gpu_use, c.hops)
    )
    chosen = near[0]
    why = f"auto chose {chosen.name}: predicted {chosen.summary()}"
    others = "; ".join(f"{c.name}: {c.summary()}" for c in candidates if c.name != chosen.name)
    if others:
        why += f" (vs {others})"
    reasons = (why,)
    if any(it.in_place for it in chosen.problem.items):
        reasons += (experts_on_cpu_reason(skeleton, chosen.problem, chosen.fill.assignment or [], workload),)
    fill = chosen.fill
    spread = interleave_streamed(chosen.problem, fill.assignment or [])
    if spread is not None:
        fill = replace(fill, assignment=spread, loads=compute_loads(chosen.problem, spread))
        reasons += (
            "disk layers spread among the resident ones: each is read from disk while the CPU computes the "
            "resident layers before it (the same bytes on each device)",
        )
    return Solution(chosen.problem, fill, f"auto:{chosen.name}", reasons)


def _solve_named(skeleton: Skeleton, problem: Problem, workload: Workload, strategy: str) -> Solution:
    if strategy == "auto":
        return _auto(skeleton, problem, workload)
    return Solution(problem, STRATEGIES[strategy](problem), strategy, (f"strategy {strategy} as requested",))


def check_strategy_name(strategy: Strategy) -> None:
    if not isinstance(strategy, Mapping) and (not isinstance(strategy, str) or strategy not in STRATEGY_NAMES):
        close = difflib.get_close_matches(str(strategy), STRATEGY_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PlanError(f"unknown strategy {strategy!r}{hint}; use one of {', '.join(STRATEGY_NAMES)} or a dict")


def solve(inputs: ResolvedInputs) -> Solution:
    """Run the strategy; on failure retry without GPUs too small to compute on. The first failure is returned
    when nothing fits (it is the problem as the user asked it, which the advice explains)."""
    strategy = inputs.strategy
    if isinstance(strategy, Mapping):
        return _solve_custom(inputs, strategy)
    check_strategy_name(strategy)
    first_failure: Solution | None = None
    for problem in fallbacks(make_problem(inputs.skeleton, inputs.hardware, inputs.workload)):
        solution = _solve_named(inputs.skeleton, problem, inputs.workload, strategy)
        if solution.fits:
            if problem.excluded:
                skipped = ", ".join(device_label(d) for d in sorted(problem.excluded))
                note = f"{skipped} left unused: too small to hold the compute buffers a GPU needs here"
                solution = replace(solution, reasons=solution.reasons + (note,))
            return solution
        first_failure = first_failure or solution
    assert first_failure is not None  # fallbacks always yields the problem itself
    return first_failure


def fits(inputs: ResolvedInputs) -> bool:
    """Whether these inputs plan (a custom map left incomplete is completed: the question is about memory)."""
    try:
        return solve(replace(inputs, complete=True)).fits
    except PlanError:
        return False
