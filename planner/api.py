"""``plan()``: the one entry point the CLI, the loader and the service call.

It resolves the three inputs (Skeleton, Hardware, Workload), sizes every block for the workload, runs the
chosen strategy (``strategies.py``), and assembles the Plan: merged device map, per-device budgets,
predictions, warnings and reasons. When nothing fits it raises a PlanError that names the shortfall and the
smallest changes that would fit (``advice.py``).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Mapping

from planner import strategies
from planner.cost_model import predict
from planner.device_map import merge_device_map, resolve_custom_map
from planner.errors import PlanError
from planner.devices import device_label, parse_device
from planner.hardware import build_hardware
from planner.sizing import (
    activation_bytes,
    logits_bytes,
    normalize_dtype,
    normalize_quantization,
    size_blocks,
)
from planner.strategies import FillResult, Loads, Problem, compute_loads
from planner.types import DeviceBudget, DeviceId, Hardware, Plan, Skeleton, Workload
from planner.units import format_bytes

STRATEGY_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")
DEFAULT_CONTEXT = 2048


def resolve_skeleton(model: Any) -> Skeleton:
    """A Skeleton from whatever the caller has: a Skeleton, a model directory, a config.json path or a dict."""
    if isinstance(model, Skeleton):
        return model
    from planner.skeleton import load_skeleton  # torch + transformers: only when a skeleton must be built

    return load_skeleton(model)


def make_workload(
    skeleton: Skeleton,
    dtype: str | None = None,
    quantization: str | None = None,
    batch_size: int = 1,
    context: int | None = None,
) -> Workload:
    for label, value in (("batch_size", batch_size), ("context", context)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{label} must be a whole number, got {value!r}")
        if value < 1:
            raise PlanError(f"{label} must be at least 1, got {value}")
    quant = normalize_quantization(quantization)
    default_dtype = skeleton.default_dtype if skeleton.default_dtype in ("float16", "bfloat16", "float32") else "float32"
    if quant and dtype is None:
        default_dtype = "float16" if default_dtype == "float32" else default_dtype
    return Workload(
        dtype=normalize_dtype(dtype, default_dtype),
        quantization=quant,
        batch_size=batch_size,
        context=context if context is not None else DEFAULT_CONTEXT,
    )


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


def make_problem(skeleton: Skeleton, hardware: Hardware, workload: Workload, pinned: Mapping[int, DeviceId] | None = None) -> Problem:
    return Problem(
        items=tuple(size_blocks(skeleton, workload)),
        hardware=hardware,
        activation=activation_bytes(skeleton, workload),
        logits=logits_bytes(skeleton, workload),
        follows=tied_follows(skeleton),
        pinned=dict(pinned or {}),
    )


def _max_gpu_util(problem: Problem, assignment: list[DeviceId]) -> float:
    loads = compute_loads(problem, assignment)
    utils = [loads.total(d.id) / d.capacity for d in problem.hardware.gpus if d.capacity > 0]
    return max(utils) if utils else 0.0


def _hops(assignment: list[DeviceId]) -> int:
    return sum(1 for a, b in zip(assignment, assignment[1:]) if a != b)


def _embedding_pins(skeleton: Skeleton, problem: Problem) -> dict[int, DeviceId]:
    """Input embeddings on the CPU: decode reads one row of them per sequence, so offloading them first costs
    almost nothing and frees their whole size for layers on the GPUs."""
    pins = {}
    tied = set(problem.follows) | set(problem.follows.values())
    for i, b in enumerate(skeleton.blocks):
        if b.is_embedding and not b.is_head and i not in tied:
            pins[i] = "cpu"
    return pins


def _solve(skeleton: Skeleton, hardware: Hardware, workload: Workload, strategy: Any, complete: bool) -> tuple[Problem, FillResult, str, list[str]]:
    """Run one strategy; return the problem, its fill, the strategy name and the reasons for the choice."""
    if isinstance(strategy, Mapping):
        placement = resolve_custom_map(skeleton, strategy, complete=complete)
        index = {b.name: i for i, b in enumerate(skeleton.blocks)}
        pinned = {index[name]: dev for name, dev in placement.items()}
        for dev in set(pinned.values()):
            if hardware.get(dev) is None:
                raise PlanError(
                    f"device map places modules on {device_label(dev)}, which is not among the planned devices "
                    f"({', '.join(device_label(d.id) for d in hardware.devices)}); add it to max_memory or --gpus"
                )
        problem = make_problem(skeleton, hardware, workload, pinned)
        result = strategies.sequential(problem)
        reasons = ["custom device map" + (", completed by the planner (sequential fill)" if complete and len(pinned) < len(skeleton.blocks) else "")]
        return problem, result, "custom", reasons
    if not isinstance(strategy, str) or strategy not in STRATEGY_NAMES:
        import difflib

        close = difflib.get_close_matches(str(strategy), STRATEGY_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PlanError(f"unknown strategy {strategy!r}{hint}; use one of {', '.join(STRATEGY_NAMES)} or a dict")
    first_failure: tuple[Problem, FillResult, str, list[str]] | None = None
    for problem in _fallbacks(make_problem(skeleton, hardware, workload)):
        solved = _solve_named(skeleton, problem, workload, strategy)
        if solved[1].assignment is not None:
            if problem.excluded:
                skipped = ", ".join(device_label(d) for d in sorted(problem.excluded))
                solved[3].append(f"{skipped} left unused: too small to hold the compute buffers a GPU needs here")
            return solved
        first_failure = first_failure or solved
    assert first_failure is not None
    return first_failure


def _fallbacks(problem: Problem):
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


def _solve_named(skeleton: Skeleton, problem: Problem, workload: Workload, strategy: str) -> tuple[Problem, FillResult, str, list[str]]:
    if strategy != "auto":
        return problem, strategies.STRATEGIES[strategy](problem), strategy, [f"strategy {strategy} as requested"]
    hardware = problem.hardware

    candidates: list[tuple[str, Problem, FillResult]] = []
    for name in ("sequential", "balanced"):  # on ties sequential wins: fewer hops for the same headroom
        candidates.append((name, problem, strategies.STRATEGIES[name](problem)))
    seq = candidates[0][2]
    if problem.gpus and hardware.get("cpu") and seq.assignment and any(not isinstance(d, int) for d in seq.assignment):
        pinned_problem = replace(problem, pinned=_embedding_pins(skeleton, problem))
        if pinned_problem.pinned:
            candidates.append(("sequential+embeddings_on_cpu", pinned_problem, strategies.sequential(pinned_problem)))
    feasible = [(n, p, r) for n, p, r in candidates if r.assignment is not None]
    if not feasible:
        return problem, seq, "auto", []
    scored = []
    for name, p, r in feasible:
        loads = r.loads or compute_loads(p, r.assignment)  # type: ignore[arg-type]
        r.loads = loads
        tps = predict(p, r.assignment, loads, workload.batch_size).decode_tokens_per_s  # type: ignore[arg-type]
        scored.append((name, p, r, tps, _max_gpu_util(p, r.assignment), _hops(r.assignment)))  # type: ignore[arg-type]
    best_tps = max(s[3] for s in scored)
    near = [s for s in scored if s[3] >= best_tps * 0.99]
    near.sort(key=lambda s: (s[4], s[5]))
    name, p, r, tps, util, hops = near[0]
    others = "; ".join(f"{s[0]}: {s[3]:.3g} tok/s, peak GPU use {s[4]:.0%}, {s[5]} hops" for s in scored if s[0] != name)
    why = f"auto chose {name}: predicted {tps:.3g} tok/s, peak GPU use {util:.0%}, {hops} hops"
    if others:
        why += f" (vs {others})"
    return p, r, f"auto:{name}", [why]


def _runs(skeleton: Skeleton, assignment: list[DeviceId]) -> list[tuple[DeviceId, int, int]]:
    runs: list[tuple[DeviceId, int, int]] = []
    for i, dev in enumerate(assignment):
        if runs and runs[-1][0] == dev and runs[-1][2] == i - 1:
            runs[-1] = (dev, runs[-1][1], i)
        else:
            runs.append((dev, i, i))
    return runs


def _assemble(
    skeleton: Skeleton, problem: Problem, assignment: list[DeviceId], workload: Workload, strategy_name: str,
    reasons: list[str], known_loads: Loads | None = None,
) -> Plan:
    hw = problem.hardware
    loads = known_loads or compute_loads(problem, assignment)
    placement = {b.name: dev for b, dev in zip(skeleton.blocks, assignment)}
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
                blocks=[b.name for b, dev in zip(skeleton.blocks, assignment) if dev == d.id],
            )
        )
    prediction = predict(problem, assignment, loads, workload.batch_size)
    offloaded = sum(it.weight for it, dev in zip(problem.items, assignment) if problem.computes_on(dev) != dev)
    reasons = list(reasons)
    for dev, a, b in _runs(skeleton, assignment):
        first, last = skeleton.blocks[a].name, skeleton.blocks[b].name
        span = first if a == b else f"{first} .. {last} ({b - a + 1} blocks)"
        cap = hw.get(dev).capacity  # type: ignore[union-attr]
        util = f", {loads.total(dev) / cap:.0%} of {format_bytes(cap)}" if cap else ""
        why = ""
        if a in problem.follows:
            why = f" (tied to {skeleton.blocks[problem.follows[a]].name})"
        elif a in problem.pinned and strategy_name.endswith("embeddings_on_cpu"):
            why = " (input embeddings: decode reads one row per token, so they are offloaded first)"
        elif a in problem.pinned:
            why = " (as the custom map says)"
        elif problem.computes_on(dev) != dev:
            why = " (offloaded: did not fit on faster devices)"
        reasons.append(f"{device_label(dev)} <- {span}{why}{util}")
    warnings = []
    if offloaded:
        where = sorted({device_label(dev) for dev in assignment if problem.computes_on(dev) != dev})
        warnings.append(
            f"{format_bytes(offloaded)} of weights offloaded to {', '.join(where)}; they are streamed to "
            f"{device_label(problem.computes_on('cpu'))} for every token, which bounds decode speed"
        )
    for d in hw.gpus:
        if d.id not in set(assignment):
            warnings.append(f"{device_label(d.id)} holds nothing under this plan")
    if strategy_name.endswith("balanced_low_0") and len(hw.gpus) < 2:
        warnings.append("balanced_low_0 needs at least two GPUs; with fewer it is the same as balanced")
    for i, anchor in problem.follows.items():
        if i > 0 and assignment[i] != assignment[i - 1]:
            warnings.append(
                f"{skeleton.blocks[i].name} shares weights with {skeleton.blocks[anchor].name} and runs on "
                f"{device_label(assignment[i])}: one extra device hop per token"
            )
    return Plan(
        model=skeleton.name,
        architecture=skeleton.architecture,
        strategy=strategy_name,
        workload=workload,
        device_map=merge_device_map(skeleton, placement),
        budgets=budgets,
        offloaded_bytes=offloaded,
        prediction=prediction,
        warnings=warnings,
        reasons=reasons,
        placement=placement,
    )


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
) -> Plan:
    """Plan where each block of ``model`` goes. See the package docstring for the accepted inputs.

    ``complete=True`` lets a custom map leave modules out for the planner to place. ``hardware`` skips
    resolution of ``max_memory``/``gpus`` (the caller built it). ``advise=False`` skips the search for changes
    that would fit when nothing does (used by that search itself).
    """
    skeleton = resolve_skeleton(model)
    workload = make_workload(skeleton, dtype, quantization, batch_size, context)
    if hardware is None:
        hardware = build_hardware(max_memory, gpus, offload_folder, gpu_reserve, bandwidths)
    if not hardware.devices:
        raise PlanError("no devices to plan for; give max_memory (e.g. {'cpu': '16GiB'}) or --gpus")
    if isinstance(strategy, str) and strategy not in STRATEGY_NAMES and strategy.strip().startswith("{"):
        import json

        strategy = json.loads(strategy)
    if isinstance(strategy, Mapping):
        strategy = {k: parse_device(v) for k, v in strategy.items()}
    problem, result, name, reasons = _solve(skeleton, hardware, workload, strategy, complete)
    if result.assignment is None:
        from planner.advice import explain_no_fit

        raise PlanError(explain_no_fit(skeleton, hardware, workload, problem, result, strategy, advise))
    return _assemble(skeleton, problem, result.assignment, workload, name, reasons, result.loads)


def fits(model: Any, **kwargs: Any) -> bool:
    """Whether ``plan(model, **kwargs)`` succeeds (no advice search)."""
    try:
        plan(model, advise=False, **kwargs)
        return True
    except PlanError:
        return False


__all__ = ["plan", "fits", "make_workload", "make_problem", "resolve_skeleton", "STRATEGY_NAMES"]
