"""Room for speculative decoding's draft model in the target's plan.

A draft model (the target's own weights quantized, ``--speculate int4|int8``, or a smaller checkpoint,
``--draft-model``) is held resident beside the target. Left out of the target's plan, it would take memory the plan
gave the target, and a box planned to the byte would run out. So the target's workload carries the draft's
:class:`~planner.types.DraftBudget`, and :func:`reserve_draft` takes its bytes (weights, working memory, and KV for
every slot at the served context) off the draft's device before the target's blocks are placed: in a box smaller
than the model the target then streams that much more of its weights, which the plan says
(:func:`draft_cost_reason`).

The reservation follows the workload, not the hardware: the server tries several batch sizes on one resolved box
(:mod:`planner.placement.served_shape`), and the draft's KV grows with each, so the hardware remembers what it holds
back (``Hardware.draft_held``) and each reservation gives that back first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from planner.errors import PlanError
from planner.hardware.devices import device_label
from planner.hardware.units import format_bytes
from planner.placement.sizing import activation_bytes, block_bytes, kv_bytes_per_layer
from planner.types import DeviceId, DraftBudget, Hardware, Skeleton, Workload

#: Most tokens one forward of a draft model feeds, all rows together (the engine's drafter prefills a context in
#: chunks of this many): what its working memory is sized for.
DRAFT_PREFILL_CHUNK = 512


def copy_draft_budget(skeleton: Skeleton, scheme: str, dtype: str) -> DraftBudget:
    """What ``--speculate int4|int8``'s copy of the target holds: every block with its linear layers in the native
    CPU format ``scheme`` and the rest in ``dtype``, on the CPU; a chunk's activations; its KV in ``dtype``."""
    copy = Workload(dtype=dtype, cpu_quantization=scheme, batch_size=1, context=1, prefill_chunk=DRAFT_PREFILL_CHUNK)
    weights = sum(block_bytes(b, copy, skeleton) for b in skeleton.blocks)
    return DraftBudget(
        label=f"{scheme} copy",
        device="cpu",
        weights=weights,
        working=activation_bytes(skeleton, replace(copy, context=DRAFT_PREFILL_CHUNK)),
        kv_per_token=kv_per_token(skeleton, dtype),
    )


def kv_per_token(skeleton: Skeleton, dtype: str) -> int:
    """Bytes one token of one sequence holds in the model's KV cache, all layers, in ``dtype``."""
    if skeleton.kv is None:
        return 0
    return skeleton.kv.num_layers * kv_bytes_per_layer(skeleton, Workload(dtype=dtype, batch_size=1, context=1))


def release_draft(hardware: Hardware) -> Hardware:
    """``hardware`` with what it held back for a draft model given back to that device."""
    if hardware.draft_held is None:
        return hardware
    device, held = hardware.draft_held
    devices = tuple(replace(d, capacity=d.capacity + held) if d.id == device else d for d in hardware.devices)
    return replace(hardware, devices=devices, draft_held=None)


def reserve_draft(hardware: Hardware, workload: Workload) -> Hardware:
    """``hardware`` with the workload's draft model taken off its device's capacity (as it is, without one)."""
    base = release_draft(hardware)
    draft = workload.draft
    if draft is None:
        return base
    device = base.get(draft.device)
    if device is None:
        raise PlanError(
            f"the draft model is planned on {device_label(draft.device)}, which is not among the devices "
            f"({', '.join(device_label(d.id) for d in base.devices)}); plan the draft on the target's devices"
        )
    need = workload.draft_bytes()
    taken = min(need, device.capacity)
    devices = tuple(replace(d, capacity=d.capacity - taken) if d.id == draft.device else d for d in base.devices)
    return replace(base, devices=devices, draft_held=(draft.device, taken))


def held_for_draft(hardware: Hardware, device: DeviceId) -> int:
    """Bytes ``hardware`` holds back on ``device`` for a draft model."""
    return hardware.draft_held[1] if hardware.draft_held and hardware.draft_held[0] == device else 0


def draft_cost_reason(
    draft: DraftBudget, workload: Workload, with_draft: Mapping[DeviceId, int], without_draft: Mapping[DeviceId, int]
) -> str:
    """The plan's sentence on what the draft costs the target: its bytes on its device, and where the target's
    weights moved to make room (``with_draft`` and ``without_draft``: the target's weights per device, planned with
    and without the reservation)."""
    kv = draft.kv_bytes(workload.batch_size, workload.context)
    cost = f"draft: {draft.label} {format_bytes(draft.weights)}"
    if draft.working:
        cost += f" + working memory {format_bytes(draft.working)}"
    cost += f" + KV {format_bytes(kv)} ({workload.batch_size} slots x {workload.context} tokens)"
    cost += f" resident on {device_label(draft.device)}"
    moves = []
    for device in sorted(set(with_draft) | set(without_draft), key=str):
        change = with_draft.get(device, 0) - without_draft.get(device, 0)
        if change:
            moves.append(f"on {device_label(device)} {'+' if change > 0 else '-'}{format_bytes(abs(change))}")
    if moves:
        return f"{cost}; target weights {', '.join(moves)}"
    return f"{cost}; the target's weights stay where they were (they fit beside it)"
