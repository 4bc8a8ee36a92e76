"""Sub-layer placement for mixture-of-experts models: the candidate ``auto`` weighs against layer-wise offload.

When a MoE model does not fit its GPUs, offloading whole layers streams every expert of every offloaded layer over
the host link on each decode step, although a step reads only the few its tokens were routed to. The alternative
(llama.cpp's ``--n-cpu-moe``, ktransformers): keep attention, norms, router and shared experts of every layer on
the GPUs, and keep routed experts in host RAM, where the CPU computes the chosen ones in place. The device map says
so in transformers' format (``model.layers.N.mlp.experts: "cpu"`` under ``model.layers.N: 0``); the loader obeys
(:mod:`loaders.cpu_experts`).

GPUs should still hold whatever fits resident: the candidates keep the first ``n`` MoE layers whole (experts
included) and split the rest, with the largest ``n`` for which nothing needs streaming, found by bisection; the
all-split candidate (``n = 0``) is offered too. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from planner.devices import device_label, is_gpu
from planner.moe import moe_layers, touched_fraction
from planner.sizing import split_experts
from planner.strategies import FillResult, Problem, sequential
from planner.types import DeviceId, Skeleton, Workload
from planner.units import format_bytes

CANDIDATE = "sequential+experts_on_cpu"


def _split_problem(skeleton: Skeleton, problem: Problem, first: int) -> Problem:
    """``problem`` with MoE layers from layer index ``first`` on cut in two, their routed experts pinned to the CPU
    and the input embeddings too (decode reads one row of them, so the GPUs keep their room for layers)."""
    items = split_experts(skeleton, list(problem.items), first)
    pos = {it.block: j for j, it in reversed(list(enumerate(items)))}  # block -> its first item
    follows = {pos[problem.items[a].block]: pos[problem.items[b].block] for a, b in problem.follows.items()}
    pinned: dict[int, DeviceId] = {pos[problem.items[a].block]: d for a, d in problem.pinned.items()}
    tied = set(follows) | set(follows.values())
    for j, it in enumerate(items):
        if it.in_place:
            pinned[j] = "cpu"
        elif it.is_embedding and not it.is_head and j not in tied:
            pinned.setdefault(j, "cpu")
    return replace(problem, items=tuple(items), follows=follows, pinned=pinned)


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
    """Why routed experts compute on the CPU under this plan, in figures."""
    on_cpu = [it for it, d in zip(problem.items, assignment) if it.in_place and d == "cpu"]
    layers = moe_layers(skeleton)
    m = layers[0]
    frac = touched_fraction(m.num_experts, m.top_k, workload.batch_size)
    total = sum(it.weight for it in on_cpu)
    read = sum(it.read_per_token for it in on_cpu)
    gpus = sorted({device_label(d) for d in assignment if is_gpu(d)})
    whole = len(layers) - len(on_cpu)
    return (
        f"routed experts of {len(on_cpu)} of {len(layers)} MoE layers ({format_bytes(total)}) stay in host RAM and "
        f"compute on the CPU: a decode step at batch {workload.batch_size} reads {m.top_k} of {m.num_experts} "
        f"experts per token, E*(1-(1-k/E)^batch) = {frac * m.num_experts:.2f} per layer ({frac:.0%}, "
        f"{format_bytes(read)} per step), instead of streaming whole layers over the host link; attention, "
        f"norms, routers and shared experts of every layer stay on {', '.join(gpus) or 'the GPUs'}"
        + (f", and {whole} MoE layer(s) are resident whole" if whole else "")
    )


__all__ = ["CANDIDATE", "experts_on_cpu_candidates", "experts_on_cpu_reason"]
