"""The placement algorithm: which device each block goes to. Pure: plain data in, plain data out, no torch.

Every strategy is the same greedy *fill* under different per-device limits:

- blocks are visited in execution order and a cursor walks the devices in order (GPUs by id, ``cpu``,
  ``disk``); a block goes on the cursor's device if it fits under that device's limit, otherwise the cursor
  moves on. Devices therefore take contiguous runs of layers and the number of device hops is minimal for
  those limits. For fixed limits this greedy fill is optimal: it fits everything whenever any contiguous
  assignment does.
- a block tied to an earlier block (GPT-2's head shares the input embedding) goes where that block went;
  a block the user pinned (custom map) or that the strategy pins (embedding offload) goes to its pin.
- what a device must hold is not only weights: the first block on a computing device brings its reserve
  (CUDA context) and the prefill activations; each decoder layer brings its KV cache to the device that
  computes it; the head brings the logits buffer. Blocks offloaded to ``cpu``/``disk`` while GPUs compute are
  streamed to the first GPU, which then also holds their KV cache and a double buffer for their weights;
  that overhead is found by refilling with the first GPU's limit lowered until the plan is consistent.

Strategies then choose the limits:

- ``sequential``: every device up to its capacity.
- ``balanced``: the smallest utilisation ``t`` such that all blocks fit with each GPU limited to
  ``t × capacity``, found by bisection; GPUs of different sizes therefore get shares in proportion. When the
  GPUs cannot hold everything, there is nothing to balance and it equals ``sequential``.
- ``balanced_low_0``: the first GPU is limited to half of its balanced share (but always takes the first
  block), the others are balanced over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from planner.placement.sizing import SizedBlock
from planner.types import Device, DeviceId, Hardware

_BISECT_STEPS = 24  # resolves utilisation to 1e-7 of capacity


@dataclass(frozen=True)
class Problem:
    """Everything the fill needs, already sized for one workload."""

    items: tuple[SizedBlock, ...]
    hardware: Hardware
    activation: int  # per computing device, once it holds any block
    logits: int  # on the device that computes the head
    follows: dict[int, int] = field(default_factory=dict)  # item -> earlier item it must share a device with
    pinned: dict[int, DeviceId] = field(default_factory=dict)  # item -> device
    #: item -> earlier item it should compute with: it goes where the fill puts it when that device computes on the
    #: same device as the earlier item, else on the earlier item's device (a rotary embedding, with the first layer).
    computes_with: dict[int, int] = field(default_factory=dict)
    #: Devices left out of this plan (a GPU too small to compute on is skipped rather than failing the plan).
    excluded: frozenset[DeviceId] = frozenset()
    #: Whether CPU decode steps run transformers' forward rather than the native step
    #: (:func:`planner.model.decode_path.runs_module_forward`): the cost model charges its per-layer overhead.
    module_forward: bool = False

    @cached_property
    def costs(self) -> tuple[list[int], list[int]]:
        """Per item: bytes on a device that computes it (weights, KV cache, logits for the head), and bytes on a
        device that only stores it (weights)."""
        own = [it.weight + it.kv + (self.logits if it.is_head else 0) for it in self.items]
        return own, [it.weight for it in self.items]

    @cached_property
    def runs_on(self) -> dict[DeviceId, DeviceId]:
        """Device -> the device that computes what is placed on it, for every device of the hardware."""
        return {d.id: self.computes_on(d.id) for d in self.hardware.devices}

    @cached_property
    def head_items(self) -> tuple[int, ...]:
        return tuple(i for i, it in enumerate(self.items) if it.is_head)

    @cached_property
    def memo(self) -> dict[tuple, FillResult]:
        """fill_consistent results by limits: strategies that fall back to one another share the work."""
        return {}

    @cached_property
    def devices(self) -> tuple[Device, ...]:
        return tuple(d for d in self.hardware.devices if d.id not in self.excluded)

    @cached_property
    def gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.kind == "gpu")

    @cached_property
    def main_gpu(self) -> DeviceId | None:
        gpus = self.gpus
        return gpus[0].id if gpus else None

    def item_runs_on(self, i: int, device: DeviceId) -> DeviceId:
        """Where item ``i`` placed on ``device`` computes: in place for routed experts kept on the CPU and for layers
        the CPU computes where they live (:attr:`~planner.placement.sizing.SizedBlock.in_place`), else as :meth:`computes_on`
        says."""
        return device if self.items[i].in_place else self.runs_on[device]

    def computes_on(self, device: DeviceId) -> DeviceId:
        """Where a block placed on ``device`` runs: GPUs run their own; offloaded blocks run on the first GPU,
        or on the CPU when there is no GPU."""
        if isinstance(device, int):
            return device
        main = self.main_gpu
        return main if main is not None else "cpu"


@dataclass
class Loads:
    """Per-device bytes of an assignment, split as the plan reports them."""

    weights: dict[DeviceId, int] = field(default_factory=dict)
    kv: dict[DeviceId, int] = field(default_factory=dict)
    activations: dict[DeviceId, int] = field(default_factory=dict)
    reserve: dict[DeviceId, int] = field(default_factory=dict)

    def total(self, device: DeviceId) -> int:
        return (
            self.weights.get(device, 0)
            + self.kv.get(device, 0)
            + self.activations.get(device, 0)
            + self.reserve.get(device, 0)
        )


def compute_loads(problem: Problem, assignment: list[DeviceId]) -> Loads:
    """Exact per-device bytes of a complete assignment (the numbers the plan reports and checks)."""
    loads = Loads()
    weights, kvs, act = loads.weights, loads.kv, loads.activations
    own, weight = problem.costs
    runs = problem.runs_on
    used_compute: set[DeviceId] = set()
    offloaded_max = 0
    for i, dev in enumerate(assignment):
        w = weight[i]
        weights[dev] = weights.get(dev, 0) + w
        runs_on = dev if problem.items[i].in_place else runs[dev]
        used_compute.add(runs_on)
        kv = problem.items[i].kv
        if kv:
            kvs[runs_on] = kvs.get(runs_on, 0) + kv
        if runs_on != dev and w > offloaded_max:
            offloaded_max = w
    if problem.logits:
        for i in problem.head_items:
            runs_on = runs[assignment[i]]
            act[runs_on] = act.get(runs_on, 0) + problem.logits
    for dev in used_compute:
        act[dev] = act.get(dev, 0) + problem.activation
        if isinstance(dev, int):
            loads.reserve[dev] = problem.hardware.gpu_reserve
    if offloaded_max:
        # Offloaded weights are staged on the computing device in two buffers: one in use, one being prefetched.
        # Without a GPU the CPU computes in place from memory maps: one block's pages are the working set.
        main = problem.computes_on("cpu")
        copies = 2 if isinstance(main, int) else 1
        act[main] = act.get(main, 0) + copies * offloaded_max
    return loads


@dataclass
class FillResult:
    assignment: list[DeviceId] | None
    #: When the fill failed: the block that did not fit and what it needed.
    stuck_item: int | None = None
    stuck_need: int = 0
    #: The exact loads of ``assignment``, when they were computed on the way.
    loads: Loads | None = None


def fill(problem: Problem, limits: dict[DeviceId, int]) -> FillResult:
    """Greedy contiguous fill of ``problem.items`` under ``limits`` (devices absent from ``limits`` are unused).

    This is the planner's inner loop (run a few dozen times per plan by the bisection), so it works on plain
    lists of precomputed costs rather than on the dataclasses.
    """
    order = [d.id for d in problem.devices if d.id in limits]
    pos = {d: k for k, d in enumerate(order)}
    lim = [limits[d] for d in order]
    load = [0] * len(order)
    started = [False] * len(order)
    computes = [problem.computes_on(d) == d for d in order]
    start_cost = [
        (problem.activation + (problem.hardware.gpu_reserve if isinstance(d, int) else 0)) if computes[k] else 0
        for k, d in enumerate(order)
    ]
    own, weight = problem.costs
    in_place = [it.in_place for it in problem.items]  # computes where it lives: brings its KV cache there
    follows, pinned = problem.follows, problem.pinned
    placed: list[int] = []
    cursor, n_dev = 0, len(order)

    def cost(i: int, k: int) -> int:
        c = own[i] if computes[k] or in_place[i] else weight[i]
        return c if started[k] else c + start_cost[k]

    for i in range(len(own)):
        anchor = problem.computes_with.get(i)
        if anchor is not None and cursor < n_dev:
            there = placed[anchor]
            if problem.computes_on(order[cursor]) != problem.computes_on(order[there]):
                c = cost(i, there)
                if load[there] + c <= lim[there]:
                    load[there] += c
                    started[there] = True
                    placed.append(there)
                    continue
        if i in follows or i in pinned:
            dev = order[placed[follows[i]]] if i in follows else pinned[i]
            k = pos.get(dev)
            if k is None:
                return FillResult(None, i, own[i])
            c = cost(i, k)
            if load[k] + c > lim[k]:
                return FillResult(None, i, c)
            load[k] += c
            started[k] = True
            placed.append(k)
            continue
        while cursor < n_dev:
            c = own[i] if computes[cursor] or in_place[i] else weight[i]
            if not started[cursor]:
                c += start_cost[cursor]
            if load[cursor] + c <= lim[cursor]:
                load[cursor] += c
                started[cursor] = True
                placed.append(cursor)
                break
            cursor += 1
        else:
            return FillResult(None, i, weight[i])
    return FillResult([order[k] for k in placed])


def fill_consistent(problem: Problem, limits: dict[DeviceId, int]) -> FillResult:
    """``fill``, then lower the fill limit of a device that ends up over its limit (the first GPU, which also
    holds what offloaded blocks need to compute) by the excess, until the plan is consistent."""
    key = tuple(sorted(limits.items(), key=lambda kv: str(kv[0])))
    if key in problem.memo:
        return problem.memo[key]
    problem.memo[key] = result = _fill_consistent(problem, limits)
    return result


def _fill_consistent(problem: Problem, limits: dict[DeviceId, int]) -> FillResult:
    target = {d: min(limits[d], dev.capacity) for d in limits for dev in problem.devices if dev.id == d}
    fill_limits = dict(target)
    for _ in range(len(problem.items) + 2):
        result = fill(problem, fill_limits)
        if result.assignment is None:
            return result
        if all(problem.computes_on(d) == d for d in set(result.assignment)):
            return result  # nothing offloaded: fill's own accounting is already exact
        loads = compute_loads(problem, result.assignment)
        over = {d: loads.total(d) - target[d] for d in target}
        over = {d: v for d, v in over.items() if v > 0}
        if not over:
            result.loads = loads
            return result
        for dev, excess in over.items():
            if fill_limits[dev] - excess < 0:
                return FillResult(None, None, excess)
            fill_limits[dev] -= excess
    return FillResult(None, None, 0)


def _full_limits(problem: Problem) -> dict[DeviceId, int]:
    return {d.id: d.capacity for d in problem.devices}


def _gpus(problem: Problem) -> list[Device]:
    return [d for d in problem.gpus if d.capacity > 0]


def sequential(problem: Problem) -> FillResult:
    return fill_consistent(problem, _full_limits(problem))


def _bisect_share(problem: Problem, gpus: list[Device], fixed: dict[DeviceId, int]) -> float | None:
    """Smallest utilisation t such that all blocks fit on ``gpus`` at ``t × capacity`` (with ``fixed`` limits
    for GPUs outside ``gpus``); ``None`` if they do not fit even at full capacity."""

    def fits(t: float) -> bool:
        limits = {d.id: int(d.capacity * t) for d in gpus}
        limits.update(fixed)
        return fill_consistent(problem, limits).assignment is not None

    if not gpus or not fits(1.0):
        return None
    lo, hi = 0.0, 1.0
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _balanced_share(problem: Problem) -> tuple[list[Device], float] | FillResult:
    """The GPUs and their optimal common utilisation, or the sequential plan when there is nothing to balance
    (fewer than two GPUs, or GPUs that cannot hold everything)."""
    gpus = _gpus(problem)
    t = _bisect_share(problem, gpus, {}) if len(gpus) >= 2 else None
    return sequential(problem) if t is None else (gpus, t)


def balanced(problem: Problem) -> FillResult:
    share = _balanced_share(problem)
    if isinstance(share, FillResult):
        return share
    gpus, t = share
    return fill_consistent(problem, {d.id: int(d.capacity * t) for d in gpus})


def balanced_low_0(problem: Problem) -> FillResult:
    share = _balanced_share(problem)
    if isinstance(share, FillResult):
        return share
    gpus, t = share
    first, rest = gpus[0], gpus[1:]
    # The first GPU keeps half of its balanced share, but always at least the first block, so it is still used.
    light = min(first.capacity, max(int(first.capacity * t * 0.5), _first_block_need(problem, first.id)))
    t_rest = _bisect_share(problem, rest, {first.id: light})
    if t_rest is None:
        return fill_consistent(problem, {d.id: int(d.capacity * t) for d in gpus})
    limits = {d.id: int(d.capacity * t_rest) for d in rest}
    limits[first.id] = light
    return fill_consistent(problem, limits)


def _first_block_need(problem: Problem, device: DeviceId) -> int:
    """What the first free block costs on ``device`` (weights, KV, reserve and activations it brings)."""
    for i, item in enumerate(problem.items):
        if i in problem.follows or i in problem.pinned:
            continue
        inc = item.weight + item.kv + problem.activation + (problem.logits if item.is_head else 0)
        if isinstance(device, int):
            inc += problem.hardware.gpu_reserve
        return inc
    return 0


STRATEGIES = {
    "sequential": sequential,
    "balanced": balanced,
    "balanced_low_0": balanced_low_0,
}
