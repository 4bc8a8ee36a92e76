"""The draft model of ``--speculate int4|int8``: the served checkpoint loaded a second time, whole on the CPU, its
linear layers quantized at load by the native CPU kernels (the same load as ``--cpu-quantization``).

Why the target's own weights: a copy that differs from the target only by rounding agrees with it on most greedy
tokens, needs no second checkpoint, and shares its tokenizer by construction. Its weights are about 1/8 (int4) or
1/4 (int8) of fp32 for the linear layers; the embeddings and norms stay in the run dtype. It is held resident (its
pages locked like the target's CPU weights), so a draft never waits on the disk the target streams from.

The target's plan reserves the copy's bytes (:func:`copy_budget`: the quantized size of every layer, the working
memory of its drafting chunk, and its KV for every slot), so in a box smaller than the model the target streams
that much more instead of the box running out; ``/info`` reports what the load measured beside what was reserved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.placement.draft_budget import copy_draft_budget
from planner.placement.inputs import PlanInputs
from planner.types import DraftBudget

log = logging.getLogger(__name__)

#: ``--speculate`` modes that load a copy, and the native CPU quantization each loads it with.
DRAFT_SCHEMES: tuple[str, ...] = ("int4", "int8")

#: Activations the native quantized kernels compute with (:mod:`loaders.native.quantization`).
DRAFT_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


@dataclass(frozen=True)
class DraftCopy:
    """The loaded draft model: the model, its scheme (``int4``/``int8`` for a copy of the target, ``model`` for
    ``--draft-model``) and dtype, the bytes it holds in memory (weights and buffers), its name (``--draft-model``'s
    directory), and what the target's plan reserved for it (bytes on its device, and the plan's sentence on what
    that cost the target)."""

    model: Any
    scheme: str
    dtype: str
    nbytes: int
    name: str | None = None
    reserved: int = 0
    cost: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scheme": self.scheme, "dtype": self.dtype, "bytes": self.nbytes}
        if self.name is not None:
            out["name"] = self.name
        if self.cost is not None:
            out["reserved_bytes"] = self.reserved
            out["cost"] = self.cost
        return out


def draft_dtype(target_dtype: str | None) -> str:
    """The copy's activation dtype: the target's when the quantized kernels run it (float32, bfloat16), else
    bfloat16 (a float16 target: the kernels have no float16 path, and bfloat16 keeps its range)."""
    return target_dtype if target_dtype in DRAFT_DTYPES else "bfloat16"


def copy_budget(path: str | Path, scheme: str, inputs: PlanInputs) -> DraftBudget:
    """What the target's plan reserves for its ``scheme`` copy: the copy's quantized bytes, in the dtype it will
    draft in (:func:`draft_dtype` of the dtype the target is planned in), from the target's Skeleton."""
    from planner.model.skeleton import load_skeleton  # the config and shard headers, read on the loading thread

    skeleton = load_skeleton(path)
    target = inputs.on_hardware(inputs.hardware()).workload(skeleton).dtype
    return copy_draft_budget(skeleton, scheme, draft_dtype(target))


def load_draft_copy(path: str | Path, scheme: str, target_dtype: str | None) -> DraftCopy:
    """Load ``path`` whole onto the CPU with ``cpu_quantization=scheme`` through the one load
    (:func:`loaders.load_checkpoint`), in :func:`draft_dtype`'s dtype."""
    if scheme not in DRAFT_SCHEMES:
        raise ValueError(f"no draft copy for {scheme!r}; use one of {', '.join(DRAFT_SCHEMES)}")
    from loaders import load_checkpoint

    dtype = draft_dtype(target_dtype)
    result = load_checkpoint(path, {"": "cpu"}, dtype=dtype, cpu_quantization=scheme, show_progress=False)
    result.model.eval()
    copy = DraftCopy(result.model, scheme, dtype, result.resident_bytes)
    log.info("draft copy of %s: %s, %s activations, %d bytes resident", path, scheme, dtype, copy.nbytes)
    return copy
