"""Planning for a cluster: one pipeline stage per host, each stage placed within its host as a one-host plan.

A pipeline is a ring. Stage 0 (rank 0, the host that serves HTTP and runs the engine) holds the blocks before the
first decoder layer (embeddings) and after the last one (final norm, head) together with the first run of layers;
stages 1..k-1 hold the following runs. Hidden states go 0 -> 1 -> ... -> k-1 and back to 0, which computes the
logits. Keeping the head with the embeddings means a tied head (GPT-2) needs no second copy, and what crosses the
last link is one hidden vector per sequence rather than a row of logits. Blocks that hold only non-persistent
buffers (rotary frequencies) are computed from the config, so every stage has them.

Layers are split in proportion to each host's compute memory, then moved one at a time off a host that does not fit.
Each stage is then planned with the ordinary one-host planner (:func:`planner.api.plan`) on its own sub-skeleton,
with the host's compute device reduced by the buffers the boundary needs: the hidden states of one micro-batch's
prefill, received and sent.

Cost model (stated in :data:`PIPELINE_COST_MODEL`): a decode step of ``m`` micro-batches over ``k`` stages takes
``max(m × (slowest stage + slowest hop), sum of stages + sum of hops)``: either the slowest stage is the bottleneck
(pipeline full) or one micro-batch's trip around the ring is. Each stage's time per micro-batch is its one-host
prediction (decode is memory-bound: a stage reads its weights once per micro-batch whatever its size).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from planner.api import plan as plan_one_host
from planner.errors import PlanError
from planner.hardware.units import DEFAULT_INTER_HOST_BANDWIDTH, format_bytes
from planner.placement.inputs import PlanInputs, make_workload, resolve_skeleton
from planner.types import DTYPE_BYTES, Block, Device, Hardware, KVGeometry, Plan, Skeleton, Workload

#: Per-message latency of the inter-host link (TCP over a data-centre network), seconds.
DEFAULT_HOP_LATENCY = 50e-6

PIPELINE_COST_MODEL = (
    "pipeline decode step of m micro-batches over k stages = max(m x (slowest stage + slowest hop), "
    "sum of stages + sum of hops); stage time = its one-host decode step (weights read once per micro-batch); "
    "hop = hidden states of one micro-batch / inter-host bandwidth + latency; tokens/s = batch / step"
)


@dataclass(frozen=True)
class Stage:
    """One host's share of the model: its blocks (execution order), its decoder layers and its one-host plan."""

    index: int
    host: int
    blocks: list[str]
    first_layer: int
    last_layer: int
    plan: Plan
    #: Predicted seconds for one micro-batch's decode step through this stage.
    seconds_per_micro_batch: float
    #: Bytes held for the boundary: one micro-batch's prefill hidden states received and sent.
    boundary_bytes: int

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stage:
        return cls(**{**d, "plan": Plan.from_dict(d["plan"]), "blocks": list(d["blocks"])})


@dataclass(frozen=True)
class Hop:
    """The link from one stage to the next (the last one closes the ring back to stage 0)."""

    source: int
    target: int
    #: Hidden states of one micro-batch: per decode step, and for a prefill of the full context.
    decode_bytes: int
    prefill_bytes: int
    bandwidth: float
    seconds: float


@dataclass(frozen=True)
class PipelinePrediction:
    decode_tokens_per_s: float
    step_seconds: float
    bottleneck: str
    cost_model: str = PIPELINE_COST_MODEL


@dataclass(frozen=True)
class ClusterPlan:
    """The cluster planner's answer: stages (one per host), hops, micro-batching and the pipeline's prediction.

    Serialises to JSON and back without loss, like :class:`~planner.types.Plan`; every rank of a pipeline computes
    it from the same inputs and compares :meth:`digest` with rank 0's.
    """

    model: str
    architecture: str
    workload: Workload
    micro_batches: int
    micro_batch_size: int
    inter_host_bandwidth: float
    stages: list[Stage]
    hops: list[Hop]
    prediction: PipelinePrediction
    reasons: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    revision: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [s.to_dict() for s in self.stages]
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterPlan:
        return cls(
            model=d["model"],
            architecture=d["architecture"],
            workload=Workload.from_dict(d["workload"]),
            micro_batches=int(d["micro_batches"]),
            micro_batch_size=int(d["micro_batch_size"]),
            inter_host_bandwidth=float(d["inter_host_bandwidth"]),
            stages=[Stage.from_dict(s) for s in d["stages"]],
            hops=[Hop(**h) for h in d["hops"]],
            prediction=PipelinePrediction(**d["prediction"]),
            reasons=list(d.get("reasons", [])),
            fingerprint=d.get("fingerprint"),
            revision=d.get("revision"),
        )

    @classmethod
    def from_json(cls, text: str) -> ClusterPlan:
        return cls.from_dict(json.loads(text))

    def digest(self) -> str:
        """A short hash of the whole plan: ranks that planned differently get different digests."""
        import hashlib

        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _layer_runs(skeleton: Skeleton) -> tuple[list[Block], list[Block], list[Block], list[Block]]:
    """(before, layers, after, replicated): blocks before the first decoder layer, the layers in order, blocks after
    the last layer, and buffer-only blocks every stage computes for itself."""
    layer_pos = [i for i, b in enumerate(skeleton.blocks) if b.layer_index is not None]
    if not layer_pos:
        raise PlanError(f"{skeleton.name} has no decoder layers to split into pipeline stages; serve it on one host")
    first, last = layer_pos[0], layer_pos[-1]
    if layer_pos != list(range(first, last + 1)):
        raise PlanError(f"{skeleton.name}: its decoder layers are not consecutive blocks; it cannot be pipelined")
    replicated = [b for b in skeleton.blocks if b.tensors and all(t.kind == "buffer_nonpersistent" for t in b.tensors)]
    rep = {b.name for b in replicated}
    before = [b for b in skeleton.blocks[:first] if b.name not in rep]
    after = [b for b in skeleton.blocks[last + 1 :] if b.name not in rep]
    return before, list(skeleton.blocks[first : last + 1]), after, replicated


def stage_skeleton(skeleton: Skeleton, index: int, layers: Sequence[Block]) -> Skeleton:
    """The sub-skeleton stage ``index`` holds (in execution order): stage 0 adds the blocks around the layers."""
    before, _, after, replicated = _layer_runs(skeleton)
    names = {b.name for b in layers} | {b.name for b in replicated}
    if index == 0:
        names |= {b.name for b in before} | {b.name for b in after}
    blocks = tuple(b for b in skeleton.blocks if b.name in names)
    kept = {t.name for b in blocks for t in b.tensors}
    tied = tuple(g for g in (tuple(t for t in group if t in kept) for group in skeleton.tied_groups) if len(g) > 1)
    kv = skeleton.kv and KVGeometry(len(layers), skeleton.kv.num_kv_heads, skeleton.kv.head_dim)
    keys = {k: v for k, v in skeleton.checkpoint_keys.items() if k in names}
    return replace(
        skeleton, name=f"{skeleton.name} [stage {index}]", blocks=blocks, tied_groups=tied, kv=kv, checkpoint_keys=keys
    )


def _compute_device(hw: Hardware) -> Device:
    gpus = hw.gpus
    if gpus:
        return gpus[0]
    for d in hw.devices:
        if d.id == "cpu":
            return d
    raise PlanError("a pipeline host needs a GPU or a cpu budget to compute on; give --gpus or --max-memory cpu=SIZE")


def _host_weight(hw: Hardware) -> int:
    """How much of the model a host should take: its GPU memory, or its RAM when it has no GPU."""
    gpus = hw.gpus
    return sum(d.capacity for d in gpus) if gpus else _compute_device(hw).capacity


def _proportional_split(num_layers: int, weights: Sequence[int]) -> list[int]:
    """Layer counts in proportion to ``weights`` (largest remainders), each at least one."""
    n = len(weights)
    if num_layers < n:
        raise PlanError(
            f"the model has {num_layers} decoder layers, fewer than the {n} hosts; use at most {num_layers}"
        )
    total = sum(weights) or n
    exact = [num_layers * (w or 1) / total for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    while sum(counts) > num_layers:
        i = max(range(n), key=lambda j: (counts[j] - exact[j], counts[j]))
        counts[i] -= 1
    order = sorted(range(n), key=lambda j: exact[j] - counts[j], reverse=True)
    k = 0
    while sum(counts) < num_layers:
        counts[order[k % n]] += 1
        k += 1
    return counts


def _hidden_bytes(skeleton: Skeleton, workload: Workload, sequences: int, tokens: int) -> int:
    return int(sequences * tokens * skeleton.hidden_size * DTYPE_BYTES[workload.dtype])


@dataclass(frozen=True)
class _StageTry:
    plan: Plan | None
    error: str | None


def _try_stage(sub: Skeleton, hw: Hardware, workload: Workload, boundary: int, strategy: str) -> _StageTry:
    dev = _compute_device(hw)
    if dev.capacity <= boundary:
        return _StageTry(None, f"its {format_bytes(dev.capacity)} cannot hold the {format_bytes(boundary)} boundary")
    devices = tuple(replace(d, capacity=d.capacity - boundary) if d.id == dev.id else d for d in hw.devices)
    try:
        p = plan_one_host(
            sub,
            strategy=strategy,
            dtype=workload.dtype,
            quantization=workload.quantization,
            batch_size=workload.batch_size,
            context=workload.context,
            cpu_quantization=workload.cpu_quantization,
            hardware=replace(hw, devices=devices),
            advise=False,
        )
        return _StageTry(p, None)
    except PlanError as e:
        return _StageTry(None, str(e).splitlines()[0])


def plan_cluster(
    model: Any,
    hosts: Sequence[PlanInputs | Hardware],
    *,
    dtype: str | None = None,
    quantization: str | None = None,
    batch_size: int = 1,
    context: int | None = None,
    strategy: str = "auto",
    micro_batches: int | None = None,
    inter_host_bandwidth: float = DEFAULT_INTER_HOST_BANDWIDTH,
    cpu_quantization: str | None = None,
) -> ClusterPlan:
    """Plan ``model`` as a pipeline over ``hosts`` (one stage each, in rank order).

    ``hosts``: each a :class:`~planner.placement.inputs.PlanInputs` (its ``max_memory``/``gpus``/bandwidths; the workload
    fields are taken from the arguments here) or a ready :class:`~planner.types.Hardware`. ``micro_batches``
    defaults to ``min(batch_size, number of hosts)``: enough to keep every stage busy when the batch allows.
    ``cpu_quantization`` (``int8``/``int4``) sizes each stage's CPU and disk layers in the native CPU formats its
    loader stores, so that a stage's resident bytes are its plan's.
    """
    if not hosts:
        raise PlanError("a cluster needs at least one host; give --nodes N or a non-empty hosts list")
    if not isinstance(strategy, str):
        raise PlanError("a cluster plan takes a strategy name (auto, balanced, sequential); custom maps are per host")
    if not isinstance(inter_host_bandwidth, (int, float)) or inter_host_bandwidth <= 0:
        raise PlanError(f"inter-host bandwidth must be a positive number of bytes/s, got {inter_host_bandwidth!r}")
    skeleton = resolve_skeleton(model)
    workload = make_workload(skeleton, dtype, quantization, batch_size, context, cpu_quantization)
    m = micro_batches if micro_batches is not None else min(batch_size, len(hosts))
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise PlanError(f"micro_batches must be a whole number of at least 1, got {m!r}")
    m = min(m, batch_size)
    micro_size = math.ceil(batch_size / m)
    hardware = [h if isinstance(h, Hardware) else h.hardware() for h in hosts]
    _, layers, _, _ = _layer_runs(skeleton)
    counts = _proportional_split(len(layers), [_host_weight(hw) for hw in hardware])
    boundary = 2 * _hidden_bytes(skeleton, workload, micro_size, workload.context) if len(hosts) > 1 else 0

    tries: list[_StageTry] = []
    for _ in range(len(layers) * len(hosts) + 1):
        tries = []
        start = 0
        for s, (hw, count) in enumerate(zip(hardware, counts)):
            sub = stage_skeleton(skeleton, s, layers[start : start + count])
            tries.append(_try_stage(sub, hw, workload, boundary, strategy))
            start += count
        failed = [s for s, t in enumerate(tries) if t.plan is None]
        if not failed or not _move_layer(counts, failed[0], {s for s, t in enumerate(tries) if t.plan is not None}):
            break
    failed = [s for s, t in enumerate(tries) if t.plan is None]
    if failed:
        detail = "; ".join(f"host {s} ({counts[s]} layers): {tries[s].error}" for s in failed)
        raise PlanError(
            f"{skeleton.name} does not fit on {len(hosts)} host(s) as a pipeline: {detail}. "
            "Add hosts (--nodes), memory per host, or use a smaller dtype or quantization"
        )
    return _assemble(skeleton, workload, hardware, counts, [t.plan for t in tries], m, micro_size, inter_host_bandwidth)


def _move_layer(counts: list[int], failed: int, fitting: set[int]) -> bool:
    """Move one layer off the failed host to its nearest neighbour that fit; False when there is none to take it."""
    if counts[failed] <= 1:
        return False
    for d in range(1, len(counts)):
        for nb in (failed - d, failed + d):
            if 0 <= nb < len(counts) and nb in fitting:
                counts[failed] -= 1
                counts[nb] += 1
                return True
    return False


def _assemble(
    skeleton: Skeleton,
    workload: Workload,
    hardware: list[Hardware],
    counts: list[int],
    plans: list[Plan | None],
    m: int,
    micro_size: int,
    bandwidth: float,
) -> ClusterPlan:
    _, layers, _, _ = _layer_runs(skeleton)
    k = len(hardware)
    boundary = 2 * _hidden_bytes(skeleton, workload, micro_size, workload.context) if k > 1 else 0
    stages: list[Stage] = []
    start = 0
    for s, (count, p) in enumerate(zip(counts, plans)):
        assert p is not None
        first, last = layers[start].layer_index, layers[start + count - 1].layer_index
        step = workload.batch_size / p.prediction.decode_tokens_per_s if p.prediction.decode_tokens_per_s else 0.0
        stages.append(Stage(s, s, list(p.placement), int(first), int(last), p, round(step, 9), boundary))  # type: ignore[arg-type]
        start += count
    hops: list[Hop] = []
    if k > 1:
        for s in range(k):
            dec = _hidden_bytes(skeleton, workload, micro_size, 1)
            pre = _hidden_bytes(skeleton, workload, micro_size, workload.context)
            hops.append(Hop(s, (s + 1) % k, dec, pre, bandwidth, round(dec / bandwidth + DEFAULT_HOP_LATENCY, 9)))
    slow = max(stages, key=lambda st: st.seconds_per_micro_batch)
    slow_hop = max((h.seconds for h in hops), default=0.0)
    bound_stage = m * (slow.seconds_per_micro_batch + slow_hop)
    bound_ring = sum(st.seconds_per_micro_batch for st in stages) + sum(h.seconds for h in hops)
    step = max(bound_stage, bound_ring)
    if k == 1:
        bottleneck = "one host: no pipeline"
    elif bound_stage >= bound_ring:
        bottleneck = f"stage {slow.index} (pipeline full: {m} micro-batches over {k} stages)"
    else:
        bottleneck = f"the ring: {m} micro-batch(es) cannot fill {k} stages; one trip around it bounds a step"
    prediction = PipelinePrediction(round(workload.batch_size / step, 4) if step else 0.0, round(step, 9), bottleneck)
    reasons = [
        f"stage {st.index} on host {st.host}: layers {st.first_layer}-{st.last_layer}"
        + (" + embeddings and head (the ring starts and ends here)" if st.index == 0 and k > 1 else "")
        + f"; {st.seconds_per_micro_batch * 1e3:.3g} ms per micro-batch"
        for st in stages
    ]
    if k > 1:
        reasons.append(
            f"layers split in proportion to each host's compute memory; boundary buffers "
            f"{format_bytes(boundary)} per stage ({micro_size} sequences x {workload.context} tokens, in and out)"
        )
    return ClusterPlan(
        model=skeleton.name,
        architecture=skeleton.architecture,
        workload=workload,
        micro_batches=m,
        micro_batch_size=micro_size,
        inter_host_bandwidth=bandwidth,
        stages=stages,
        hops=hops,
        prediction=prediction,
        reasons=reasons,
        fingerprint=skeleton.fingerprint,
        revision=skeleton.revision,
    )


__all__ = [
    "ClusterPlan",
    "Hop",
    "PipelinePrediction",
    "Stage",
    "plan_cluster",
    "stage_skeleton",
]
