"""``/plan`` with a ``hosts`` list: a dry run of the cluster planner, answered with the ClusterPlan JSON.

Each host carries the same hardware fields as a one-host ``/plan`` request (``max_memory``, ``gpus``); the workload
(dtype, quantization, batch, context, strategy) is the request's, shared by every host, as a pipeline runs one
model with one workload. ``micro_batches`` and ``inter_host_bandwidth`` only mean something with hosts, and are
refused without them; so is ``what_if``, which answers for one host.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from planner.model.skeleton import Skeleton
from planner.placement.inputs import PlanInputs
from service.errors import RequestValidationError

#: Most hosts one /plan request may name: planning is linear in hosts, and bounded work is a service rule.
MAX_HOSTS = 64


class HostSpec(BaseModel):
    """One host of a cluster: its memory limits and declared GPUs, as in a one-host ``/plan``."""

    model_config = ConfigDict(extra="forbid")

    max_memory: dict[str, int | str] | None = Field(None, description='e.g. {"0": "80GiB", "cpu": "512GiB"}')
    gpus: str | list[int | str] | None = Field(None, description='Declared GPUs, e.g. "4x80GB".')


def check_cluster_request(body: Any) -> None:
    """Refuse field combinations a cluster (or one host) request cannot honour, naming the field."""
    if body.hosts is None:
        extra = [f for f in ("micro_batches", "inter_host_bandwidth") if getattr(body, f) is not None]
        if extra:
            raise RequestValidationError(f"{', '.join(extra)}: only for a cluster plan; give a hosts list too.")
        return
    if body.max_memory is not None or body.gpus is not None:
        raise RequestValidationError(
            "max_memory/gpus: with hosts, give each host its own max_memory and gpus inside the hosts list."
        )
    if body.what_if is not None:
        raise RequestValidationError("what_if: answers for one host; leave it out of a cluster plan (hosts).")
    if not isinstance(body.strategy, str):
        raise RequestValidationError("strategy: a cluster plan takes a strategy name (auto, balanced, sequential).")


def cluster_answer(skeleton: Skeleton, body: Any) -> dict[str, Any]:
    """The ClusterPlan of ``skeleton`` over ``body.hosts`` as JSON (``ClusterPlan.from_dict`` reads it back)."""
    from planner.cluster import plan_cluster
    from planner.hardware.units import DEFAULT_INTER_HOST_BANDWIDTH, parse_rate

    bandwidth = body.inter_host_bandwidth
    if bandwidth is None:
        rate = DEFAULT_INTER_HOST_BANDWIDTH
    elif isinstance(bandwidth, str):
        rate = parse_rate(bandwidth)
    else:
        rate = float(bandwidth)
    hosts = [PlanInputs(max_memory=h.max_memory, gpus=h.gpus) for h in body.hosts]
    return plan_cluster(
        skeleton,
        hosts,
        dtype=body.dtype,
        quantization=body.quantization,
        batch_size=body.batch_size,
        context=body.context,
        strategy=body.strategy,
        micro_batches=body.micro_batches,
        inter_host_bandwidth=rate,
    ).to_dict()
