"""What to say when nothing fits: the shortfall in bytes per device, and the smallest changes that would fit.

Also the what-if searches the service's ``/plan`` offers: the largest context, or batch, that fits.
Every suggestion is checked by planning again with the change applied; nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.hardware.devices import device_label, gpu_range_label, is_gpu
from planner.hardware.units import format_bytes
from planner.placement.cost_model import compute_dtype
from planner.placement.inputs import ResolvedInputs, Strategy
from planner.placement.solve import Solution, fallbacks, fits, lone_speed, make_problem, solve
from planner.placement.strategies import Problem, compute_loads, sequential
from planner.types import DeviceId, Hardware, Skeleton, Workload


@dataclass(frozen=True)
class Shortfall:
    """What a plan would need per device if the last device could overflow, and the bytes missing in all."""

    need: dict[DeviceId, int]
    missing: int


def _feasible(skeleton: Skeleton, hardware: Hardware, workload: Workload, strategy: Strategy) -> bool:
    return fits(ResolvedInputs(skeleton, hardware, workload, strategy))


def _lone_speed(skeleton: Skeleton, hardware: Hardware, workload: Workload, strategy: Strategy) -> str:
    """`` (one stream: N tokens/s)``: the predicted decode of one stream on the plan the change would give, so the
    options can be weighed; empty where that plan does not fit after all."""
    solution = solve(ResolvedInputs(skeleton, hardware, workload, strategy))
    if not solution.fits:
        return ""
    lone = make_problem(skeleton, hardware, replace(workload, batch_size=1))
    return f" (one stream: {lone_speed(solution, lone, compute_dtype(workload)):.3g} tokens/s)"


def _more_cpu_memory(hardware: Hardware, extra: int) -> Hardware | None:
    """``hardware`` with ``extra`` bytes more of CPU RAM; None without a CPU device."""
    if not any(d.id == "cpu" for d in hardware.devices):
        return None
    return replace(
        hardware,
        devices=tuple(replace(d, capacity=d.capacity + extra) if d.id == "cpu" else d for d in hardware.devices),
    )


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Largest n in [lo, hi] with ok(n), assuming ok is monotone (true up to some n). None if ok(lo) fails."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_context(
    skeleton: Skeleton, hardware: Hardware, workload: Workload, strategy: Strategy = "auto", limit: int = 1 << 22
) -> int | None:
    """The longest context that fits with this batch (None when not even one token does)."""
    return _largest(1, limit, lambda c: _feasible(skeleton, hardware, replace(workload, context=c), strategy))


def largest_batch(
    skeleton: Skeleton, hardware: Hardware, workload: Workload, strategy: Strategy = "auto", limit: int = 1 << 16
) -> int | None:
    """The largest batch that fits at this context (None when not even one sequence does)."""
    return _largest(1, limit, lambda b: _feasible(skeleton, hardware, replace(workload, batch_size=b), strategy))


def shortfall(problem: Problem) -> Shortfall:
    """Per-device need when the last device is allowed to overflow, and the total bytes missing."""
    devices = problem.hardware.devices
    last = devices[-1].id
    unlimited = replace(problem.hardware, devices=devices[:-1] + (replace(devices[-1], capacity=1 << 62),))
    assignment = None
    for candidate in fallbacks(replace(problem, hardware=unlimited)):
        assignment = sequential(candidate).assignment
        if assignment is not None:
            problem = candidate
            break
    if assignment is None:  # pins that overflow their device: charge them there, everything free to the last device
        assignment = []
        for i in range(len(problem.items)):
            if i in problem.follows:
                assignment.append(assignment[problem.follows[i]])
            else:
                assignment.append(problem.pinned.get(i, last))
    loads = compute_loads(problem, assignment)
    need = {d.id: loads.total(d.id) for d in devices}
    need.update({dev: loads.total(dev) for dev in set(assignment) if dev not in need})
    missing = sum(max(0, need[d.id] - d.capacity) for d in devices)
    return Shortfall(need, missing)


def _describe_devices(hardware: Hardware) -> str:
    """``GPU 0-3 24.0GiB each, cpu 64.0GiB``: runs of same-sized GPUs are named once."""
    parts: list[str] = []
    run: list = []  # consecutive GPUs of one capacity

    def flush() -> None:
        if run:
            ids = gpu_range_label(run[0].id, run[-1].id)
            parts.append(f"{ids} {format_bytes(run[0].capacity)}" + (" each" if len(run) > 1 else ""))
            run.clear()

    for d in hardware.devices:
        if d.kind == "gpu" and run and (d.capacity != run[0].capacity or d.id != run[-1].id + 1):
            flush()
        if d.kind == "gpu":
            run.append(d)
        else:
            flush()
            parts.append(f"{device_label(d.id)} {format_bytes(d.capacity)}")
    flush()
    return ", ".join(parts)


def _quantization_option(skeleton: Skeleton, hardware: Hardware, workload: Workload, strategy: Strategy) -> str | None:
    """The smallest quantization that fits, as the flag that gets it.

    With a GPU that is bitsandbytes (``--quantization``). Without one, every layer computes on the CPU, where
    bitsandbytes is the slowest path and the native int8 / 4-bit kernels the fastest, so the advice names
    ``--cpu-quantization``, checked with the native formats' own byte counts.
    """
    cpu_only = not any(is_gpu(d.id) for d in hardware.devices)
    for bnb, native in (("int8", "int8"), ("nf4", "int4")):
        if cpu_only:
            dtype = workload.dtype if workload.dtype in ("float32", "bfloat16") else "bfloat16"
            changed = replace(workload, cpu_quantization=native, dtype=dtype)
            if _feasible(skeleton, hardware, changed, strategy):
                speed = _lone_speed(skeleton, hardware, changed, strategy)
                return f"quantize to {native} on the CPU's native kernels (--cpu-quantization {native}){speed}"
            continue
        dtype = workload.dtype if workload.dtype != "float32" else "float16"
        changed = replace(workload, quantization=bnb, dtype=dtype)
        if _feasible(skeleton, hardware, changed, strategy):
            return f"quantize to {bnb} (--quantization {bnb}){_lone_speed(skeleton, hardware, changed, strategy)}"
    return None


def explain_no_fit(inputs: ResolvedInputs, solution: Solution, advise: bool = True) -> str:
    """Why ``solution`` (which does not fit) failed, in bytes per device, and, with ``advise``, every single change
    that would fit (each checked by solving again)."""
    skeleton, hardware, workload, strategy = inputs.skeleton, inputs.hardware, inputs.workload, inputs.strategy
    problem = solution.problem
    caps = _describe_devices(hardware)
    gap = shortfall(problem)
    need, missing = gap.need, gap.missing
    short = "; ".join(
        f"{device_label(d.id)} needs {format_bytes(need[d.id])} of {format_bytes(d.capacity)} "
        f"(short by {need[d.id] - d.capacity} B)"
        for d in hardware.devices
        if need.get(d.id, 0) > d.capacity
    )
    lines = [f"{skeleton.name} does not fit: {short or f'short by {missing} B'} (devices: {caps})."]
    biggest = max(problem.items, key=lambda it: it.weight, default=None)
    if biggest is not None and all(biggest.weight > d.capacity for d in hardware.devices):
        lines.append(
            f"Its largest block {biggest.name} alone takes {format_bytes(biggest.weight)}, more than any device."
        )
    if not advise:
        return " ".join(lines)
    more = _more_cpu_memory(hardware, missing)
    speed = _lone_speed(skeleton, more, workload, strategy) if more is not None else ""
    disk = "" if any(d.id == "disk" for d in hardware.devices) else " or an offload folder for disk"
    options = [f"add {format_bytes(missing)} ({missing} B) of memory, e.g. more cpu RAM{speed}{disk}"]
    if workload.dtype == "float32":
        w = replace(workload, dtype="bfloat16")
        if _feasible(skeleton, hardware, w, strategy):
            options.append(f"run in bf16 (--dtype bf16){_lone_speed(skeleton, hardware, w, strategy)}")
    if workload.quantization is None and workload.cpu_quantization is None:
        option = _quantization_option(skeleton, hardware, workload, strategy)
        if option:
            options.append(option)
    if workload.context > 1:
        c = _largest(
            1, workload.context - 1, lambda c: _feasible(skeleton, hardware, replace(workload, context=c), strategy)
        )
        if c:
            speed = _lone_speed(skeleton, hardware, replace(workload, context=c), strategy)
            options.append(f"a context of at most {c} tokens (--context {c}){speed}")
    if workload.batch_size > 1:
        b = _largest(
            1,
            workload.batch_size - 1,
            lambda b: _feasible(skeleton, hardware, replace(workload, batch_size=b), strategy),
        )
        if b:
            speed = _lone_speed(skeleton, hardware, replace(workload, batch_size=b), strategy)
            options.append(f"a batch of at most {b} (--batch-size {b}){speed}")
    lines.append("Any one of these would fit: " + "; ".join(options) + ".")
    return " ".join(lines)
