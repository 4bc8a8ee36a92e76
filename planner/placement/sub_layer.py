"""Sub-layer placement for mixture-of-experts models: the candidate ``auto`` weighs against layer-wise offload.

When a MoE model does not fit its GPUs, offloading whole layers streams every expert of every offloaded layer over
the host link on each decode step, although a step reads only the few its tokens were routed to. The alternative
(llama.cpp's ``--n-cpu-moe``, ktransformers): keep attention, norms, router and shared experts of every layer on
the GPUs, and keep routed experts in host RAM, where the CPU computes the chosen ones in place. The device map says
so in transformers' format (``model.layers.N.mlp.experts: "cpu"`` under ``model.layers.N: 0``); the loader obeys
(:mod:`loaders.run.cpu_experts`).

GPUs should still hold whatever fits resident: the candidates keep the first ``n`` MoE layers whole (experts
included) and split the rest, with the largest ``n`` for which nothing needs streaming, found by bisection; the
all-split candidate (``n = 0``) is offered too.

When even the layers without their experts do not all fit the GPUs (DeepSeek-V3's 61 attention blocks on one
24 GiB GPU), the all-split candidate streams the non-expert parts that did not fit to the first GPU on every step,
which also costs that GPU a double buffer and their KV cache. The ``cpu_layers`` candidate computes those layers
wholly on the CPU where they live instead, with their KV cache in host RAM: a step reads their attention at host
memory speed and only the experts it routes to, and the GPUs keep their room for more layers. ``auto`` weighs the
two by predicted tokens/s. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from planner.hardware.devices import device_label, is_gpu
from planner.hardware.units import format_bytes
from planner.model.moe import moe_layers, touched_fraction
from planner.placement.sizing import split_experts
from planner.placement.strategies import FillResult, Problem, sequential
from planner.types import DeviceId, Skeleton, Workload

CANDIDATE = "sequential+experts_on_cpu"
#: The candidate whose layers that do not fit the GPUs compute wholly on the CPU (see the module's docstring).
CPU_LAYERS_CANDIDATE = f"{CANDIDATE}+cpu_layers"


def _split_problem(skeleton: Skeleton, problem: Problem, first: int) -> Problem:
    """``problem`` with MoE layers from layer index ``first`` on cut in two, their routed experts pinned to the CPU
    and the input embeddings too (decode reads one row of them, so the GPUs keep their room for layers)."""
    items = split_experts(skeleton, list(problem.items), first)
    pos = {it.block: j for j, it in reversed(list(enumerate(items)))}  # block -> its first item
    follows = {pos[problem.items[a].block]: pos[problem.items[b].block] for a, b in problem.follows.items()}
    pinned: dict[int, DeviceId] = {pos[problem.items[a].block]: d for a, d in problem.pinned.items()}
    computes_with = {pos[problem.items[a].block]: pos[problem.items[b].block] for a, b in problem.computes_with.items()}
    tied = set(follows) | set(follows.values())
    for j, it in enumerate(items):
        if it.in_place:
            pinned[j] = "cpu"
        elif it.is_embedding and not it.is_head and j not in tied:
            pinned.setdefault(j, "cpu")
    return replace(problem, items=tuple(items), follows=follows, pinned=pinned, computes_with=computes_with)


def _cpu_layers_problem(problem: Problem) -> Problem:
    """``problem`` (already split) where every decoder layer, and the final norm and head after them, computes on
    the device it is placed on: on the CPU, in place, rather than streamed to the first GPU. Items tied to another
    (a head sharing the embedding) or computed with another (the rotary embedding, with the first layer) keep the
    ordinary rule, and ``disk`` is left out: a layer the CPU computes must be resident in host RAM."""
    tied = set(problem.follows) | set(problem.follows.values()) | set(problem.computes_with)
    last_layer = max((j for j, it in enumerate(problem.items) if it.is_layer), default=-1)
    items = tuple(
        replace(it, in_place=True) if j not in tied and not it.is_embedding and (it.is_layer or j > last_layer) else it
        for j, it in enumerate(problem.items)
    )
    excluded = problem.excluded | ({"disk"} if problem.hardware.get("disk") is not None else set())
    return replace(problem, items=items, excluded=frozenset(excluded))


def _streams_nothing(problem: Problem, result: FillResult) -> bool:
    a = result.assignment
    return a is not None and all(
        problem.item_runs_on(i, d) == d or problem.items[i].is_embedding for i, d in enumerate(a)
    )


def experts_on_cpu_candidates(skeleton: Skeleton, problem: Problem) -> list[tuple[str, Problem, FillResult]]:
    """(name, problem, fill) of the sub-layer candidates; none when the model has no routed experts."""
    layers = sorted({m.layer_index for m in moe_layers(skeleton)})
    if not layers or problem.hardware.get("cpu") is None or "cpu" in problem.excluded:
        return []
    all_split = _split_problem(skeleton, problem, 0)
    out = [(CANDIDATE, all_split, sequential(all_split))]
    if not _streams_nothing(all_split, out[0][2]):
        # the layers without their experts do not all fit the GPUs: the rest may compute on the CPU instead
        cpu_layers = _cpu_layers_problem(all_split)
        fill = sequential(cpu_layers)
        if fill.assignment is not None and any(
            it.is_layer and is_gpu(d) for it, d in zip(cpu_layers.items, fill.assignment)
        ):  # a GPU that computes no layer is no candidate: the CPU-only plan is the fallback's
            out.append((CPU_LAYERS_CANDIDATE, cpu_layers, fill))
        return out
    lo, hi = 0, len(layers)  # lo: whole layers known to stream nothing; hi: an upper bound
    best: tuple[Problem, FillResult] | None = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = layers[mid] if mid < len(layers) else layers[-1] + 1
        p = _split_problem(skeleton, problem, first)
        r = sequential(p)
        if _streams_nothing(p, r):
            lo, best = mid, (p, r)
        else:
            hi = mid - 1
    if best is not None and lo > 0:
        out.append((f"{CANDIDATE}_after_{lo}_whole_layers", best[0], best[1]))
    return out


def experts_on_cpu_reason(skeleton: Skeleton, problem: Problem, assignment: list[DeviceId], workload: Workload) -> str:
    """Why routed experts compute on the CPU under this plan, in figures; and, when the layers without their experts
    did not all fit the GPUs, what became of the others (computed on the CPU, or streamed)."""
    items = problem.items
    on_cpu = [
        it for it, d in zip(items, assignment) if it.in_place and not it.is_layer and it.expert_weight and d == "cpu"
    ]
    cpu_layers = [it for it, d in zip(items, assignment) if it.in_place and it.is_layer and d == "cpu"]
    streamed = [
        it for i, (it, d) in enumerate(zip(items, assignment)) if it.is_layer and problem.item_runs_on(i, d) != d
    ]
    gpu_layers = [it for it, d in zip(items, assignment) if it.is_layer and is_gpu(d)]
    n_layers = sum(1 for it in items if it.is_layer)
    layers = moe_layers(skeleton)
    m = layers[0]
    frac = touched_fraction(m.num_experts, m.top_k, workload.batch_size)
    total = sum(it.weight for it in on_cpu)
    read = sum(it.read_per_token for it in on_cpu)
    gpus = sorted({device_label(d) for d in assignment if is_gpu(d)})
    whole = len(layers) - len(on_cpu)
    where = ", ".join(gpus) or "the GPUs"
    text = (
        f"routed experts of {len(on_cpu)} of {len(layers)} MoE layers ({format_bytes(total)}) stay in host RAM and "
        f"compute on the CPU: a decode step at batch {workload.batch_size} reads {m.top_k} of {m.num_experts} "
        f"experts per token, E*(1-(1-k/E)^batch) = {frac * m.num_experts:.2f} per layer ({frac:.0%}, "
        f"{format_bytes(read)} per step), instead of streaming whole layers over the host link; "
    )
    if not cpu_layers and not streamed:
        text += f"attention, norms, routers and shared experts of every layer stay on {where}"
    else:
        text += (
            f"attention, norms, routers and shared experts of {len(gpu_layers)} of {n_layers} layers stay on {where}"
        )
    if whole:
        text += f", and {whole} MoE layer(s) are resident whole"
    if cpu_layers:
        rest = sum(it.weight for it in cpu_layers)
        text += (
            f"; the other {len(cpu_layers)} layers did not fit the GPUs even without their experts and compute wholly "
            f"on the CPU where they live ({format_bytes(rest)} besides their experts, KV cache in host RAM): a step "
            "reads them at host memory speed and only the experts it routes to, where streaming them would copy "
            f"them to {device_label(problem.computes_on('cpu'))} every step and hold a double buffer and their KV "
            "cache there"
        )
    if streamed:
        rest = sum(it.weight for it in streamed)
        text += (
            f"; the other {len(streamed)} layers did not fit the GPUs even without their experts: their attention, "
            f"norms and routers ({format_bytes(rest)}) are streamed to {device_label(problem.computes_on('cpu'))} "
            "every step"
        )
    return text


__all__ = ["CANDIDATE", "CPU_LAYERS_CANDIDATE", "experts_on_cpu_candidates", "experts_on_cpu_reason"]
