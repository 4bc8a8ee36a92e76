"""The draft model of ``--speculate int4|int8``: the served checkpoint loaded a second time, whole on the CPU, its
linear layers quantized at load by the native CPU kernels (the same load as ``--cpu-quantization``).

Why the target's own weights: a copy that differs from the target only by rounding agrees with it on most greedy
tokens, needs no second checkpoint, and shares its tokenizer by construction. Its weights are about 1/8 (int4) or
1/4 (int8) of fp32 for the linear layers; the embeddings and norms stay in the run dtype. It is held resident (its
pages locked like the target's CPU weights), so a draft never waits on the disk the target streams from.

The target's plan does not budget the copy's bytes yet: they are measured here and reported (``/info``'s
speculation section), and the operator leaves room for them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: ``--speculate`` modes that load a copy, and the native CPU quantization each loads it with.
DRAFT_SCHEMES: tuple[str, ...] = ("int4", "int8")

#: Activations the native quantized kernels compute with (:mod:`loaders.native.quantization`).
DRAFT_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


@dataclass(frozen=True)
class DraftCopy:
    """The loaded copy: the model, its scheme and dtype, and the bytes it holds in memory (weights and buffers)."""

    model: Any
    scheme: str
    dtype: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "dtype": self.dtype, "bytes": self.nbytes}


def draft_dtype(target_dtype: str | None) -> str:
    """The copy's activation dtype: the target's when the quantized kernels run it (float32, bfloat16), else
    bfloat16 (a float16 target: the kernels have no float16 path, and bfloat16 keeps its range)."""
    return target_dtype if target_dtype in DRAFT_DTYPES else "bfloat16"


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
