"""``loadmaster plan --nodes N``: the cluster plan (one pipeline stage per host) for people or as JSON.

Every host gets the same planning flags (``--gpus``, ``--max-memory``, ``--bandwidth``...), as the issue's
``--nodes 2 --gpus 4x80GB`` reads; a cluster of unlike hosts is planned from Python or ``/plan`` with a ``hosts`` list.
"""

from __future__ import annotations

import argparse

from planner.cluster import ClusterPlan, plan_cluster
from planner.errors import PlanError
from planner.hardware.devices import device_label
from planner.hardware.units import DEFAULT_INTER_HOST_BANDWIDTH, format_bytes, parse_rate
from planner.placement.inputs import PlanInputs


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (pipeline over several hosts)")
    g.add_argument(
        "--nodes", type=int, default=1, help="hosts in the pipeline, one stage each, each with the flags above"
    )
    g.add_argument(
        "--inter-host-bandwidth",
        default=None,
        metavar="RATE",
        help=f"link between hosts per second, e.g. 100Gb or 12.5GB (default {format_bytes(DEFAULT_INTER_HOST_BANDWIDTH)}/s, 10 GbE)",
    )
    g.add_argument(
        "--micro-batches", type=int, default=None, help="micro-batches per step (default: min(batch size, nodes))"
    )


def cluster_plan_from_args(args: argparse.Namespace, host: PlanInputs) -> ClusterPlan:
    if args.nodes < 1:
        raise PlanError(f"--nodes must be at least 1, got {args.nodes}")
    strategy = host.strategy
    if not isinstance(strategy, str):
        raise PlanError("--nodes takes a strategy name (auto, balanced, sequential), not a custom device map")
    return plan_cluster(
        args.model,
        [host] * args.nodes,
        dtype=host.dtype,
        quantization=host.quantization,
        batch_size=host.batch_size,
        context=host.context,
        strategy=strategy,
        micro_batches=args.micro_batches,
        inter_host_bandwidth=parse_rate(args.inter_host_bandwidth),
    )


def format_cluster_plan(cp: ClusterPlan) -> str:
    w = cp.workload
    lines = [
        f"Pipeline plan for {cp.model} ({cp.architecture}) over {len(cp.stages)} host(s): {w.dtype}"
        f"{', ' + w.quantization if w.quantization else ''}, batch {w.batch_size} x context {w.context}, "
        f"{cp.micro_batches} micro-batch(es) of {cp.micro_batch_size}",
        "",
        f"{'stage':<6} {'host':<5} {'layers':<9} {'blocks':>6} {'weights':>9} {'KV cache':>9} {'boundary':>9} "
        f"{'ms/micro':>9}  devices",
    ]
    for st in cp.stages:
        weights = sum(b.weights for b in st.plan.budgets)
        kv = sum(b.kv_cache for b in st.plan.budgets)
        devices = ", ".join(
            f"{device_label(b.device)} {format_bytes(b.total)}/{format_bytes(b.capacity)}"
            for b in st.plan.budgets
            if b.blocks or b.total
        )
        lines.append(
            f"{st.index:<6} {st.host:<5} {f'{st.first_layer}-{st.last_layer}':<9} {len(st.blocks):>6} "
            f"{format_bytes(weights):>9} {format_bytes(kv):>9} {format_bytes(st.boundary_bytes):>9} "
            f"{st.seconds_per_micro_batch * 1e3:>9.3g}  {devices}"
        )
    if cp.hops:
        lines += ["", "hops (hidden states of one micro-batch):"]
        for h in cp.hops:
            lines.append(
                f"  stage {h.source} -> {h.target}: {format_bytes(h.decode_bytes)} per decode step, "
                f"{format_bytes(h.prefill_bytes)} per prefill, at {format_bytes(h.bandwidth)}/s: {h.seconds * 1e6:.3g} us"
            )
    p = cp.prediction
    lines += [
        "",
        f"predicted decode: {p.decode_tokens_per_s:.4g} tokens/s (batch {w.batch_size}), step {p.step_seconds * 1e3:.3g} ms;"
        f" bottleneck: {p.bottleneck}",
        f"cost model: {p.cost_model}",
        "",
        "why:",
    ]
    lines += [f"  {r}" for r in cp.reasons]
    for st in cp.stages:
        for warning in st.plan.warnings:
            lines.append(f"  ! stage {st.index}: {warning}")
    return "\n".join(lines)
