"""Mixture-of-experts layers as the planner sees them: which tensors are the routed experts, the router and the
shared experts of each decoder layer, and what a decode step really reads of them.

Why this is its own module: a MoE layer is one no-split block to the layer-wise strategies, but two very different
things to the cost model. The router, attention, norms and shared experts are read whole on every step; of the
``E`` routed experts a step reads only those its tokens were sent to. With ``k`` experts per token and tokens routed
independently with uniform marginals, one expert escapes all ``B`` tokens of a batch with probability
``(1 - k/E)^B``, so a decode step reads ``E * (1 - (1 - k/E)^B)`` experts per layer (``k`` at batch 1). Prefill
touches all of them. Plain data in and out: no torch.

Routed experts are found by their names, the way transformers 5 builds every MoE family: a module path ending in
``.experts`` whose tensors are fused 3-D ``[E, ...]`` parameters (Mixtral, Qwen-MoE, DeepSeek-V3, GPT-OSS), or
holds one sub-module per expert (``experts.N.w1.weight``, as checkpoint keys spell them). ``shared_expert(s)`` are
dense MLPs every token passes through and are not routed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from planner.types import TensorSpec

_EXPERTS_RE = re.compile(r"^(.*\.experts)\.(.+)$")
_ROUTER_LEAVES = (".gate.", ".router.")


@dataclass(frozen=True)
class MoELayer:
    """One decoder layer's mixture of experts.

    ``experts`` is the module path of the routed experts (a device-map key: ``model.layers.7.mlp.experts``) and
    ``expert_tensors`` their tensors; ``router`` and ``shared`` name the router's and the shared experts' tensors
    (they stay with the rest of the layer).
    """

    layer: str
    layer_index: int
    experts: str
    num_experts: int
    top_k: int
    expert_tensors: tuple[TensorSpec, ...]
    router: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts a decode step of ``batch`` tokens reads: ``E * (1 - (1 - k/E)^B)``."""
    if num_experts <= 0:
        return 0.0
    k = min(max(top_k, 0), num_experts)
    if k == 0:  # routing unknown: assume every expert is read (the dense, pessimistic figure)
        return float(num_experts)
    return num_experts * (1.0 - (1.0 - k / num_experts) ** max(batch, 1))


def touched_fraction(num_experts: int, top_k: int, batch: int) -> float:
    """The share of a layer's routed-expert bytes one decode step reads."""
    return expected_experts_touched(num_experts, top_k, batch) / num_experts if num_experts > 0 else 1.0


def _expert_count(module: str, tensors: list[TensorSpec]) -> int:
    """E: the leading dim of fused ``[E, ...]`` tensors, else the number of per-expert sub-modules."""
    fused = [t.shape[0] for t in tensors if len(t.shape) >= 2 and t.name.count(".") == module.count(".") + 1]
    if fused:
        return int(max(fused))
    ids = {t.name[len(module) + 1 :].split(".", 1)[0] for t in tensors}
    return sum(1 for i in ids if i.isdigit())


def moe_layers_of(blocks, top_k: int) -> tuple[MoELayer, ...]:
    """Every decoder layer of ``blocks`` that has routed experts, in block order (``top_k``: experts per token)."""
    out: list[MoELayer] = []
    for b in blocks:
        if b.layer_index is None:
            continue
        by_module: dict[str, list[TensorSpec]] = {}
        router: list[str] = []
        shared: list[str] = []
        for t in b.tensors:
            if "shared_expert" in t.name:
                shared.append(t.name)
                continue
            m = _EXPERTS_RE.match(t.name)
            if m:
                by_module.setdefault(m.group(1), []).append(t)
            elif (".mlp" in t.name or ".block_sparse_moe." in t.name) and any(r in t.name for r in _ROUTER_LEAVES):
                router.append(t.name)
        for module, tensors in by_module.items():
            n = _expert_count(module, tensors)
            if n > 1:
                out.append(
                    MoELayer(b.name, b.layer_index, module, n, top_k, tuple(tensors), tuple(router), tuple(shared))
                )
    return tuple(out)


def moe_layers(skeleton) -> tuple[MoELayer, ...]:
    """The skeleton's MoE layers (see :func:`moe_layers_of`)."""
    return moe_layers_of(skeleton.blocks, skeleton.experts_per_token)


def expert_bytes(layer: MoELayer, tensor_bytes) -> tuple[int, float]:
    """(all routed-expert bytes of ``layer``, bytes of one expert), sizing each tensor with ``tensor_bytes``."""
    total = sum(tensor_bytes(t) for t in layer.expert_tensors)
    return total, total / layer.num_experts


def sparse_read(total_expert_bytes: int, layer: MoELayer, batch: int) -> int:
    """Bytes of ``layer``'s routed experts one decode step of ``batch`` sequences reads."""
    return int(math.ceil(total_expert_bytes * touched_fraction(layer.num_experts, layer.top_k, batch)))


def unquantized_experts_warning(skeleton, workload, tensor_bytes) -> str | None:
    """The plan's warning when ``workload.quantization`` (bitsandbytes) cannot apply to the routed experts.

    bitsandbytes replaces ``nn.Linear`` modules; transformers 5 keeps each MoE layer's experts as fused 3-D
    parameters, which it leaves in the compute dtype. The planner sizes them so (they are not ``quantizable``);
    this says which they are and what they cost, so a user who asked for 4-bit knows most bytes are not.
    """
    if not workload.quantization:
        return None
    layers = moe_layers(skeleton)
    fused = [t for m in layers for t in m.expert_tensors if len(t.shape) == 3 and not t.quantizable]
    if not fused:
        return None
    total = sum(tensor_bytes(t) for t in fused)
    leaves = sorted({t.name.rpartition(".")[2] for t in fused})
    example = f"{layers[0].experts}.{{{','.join(leaves)}}}"
    return (
        f"--quantization {workload.quantization} (bitsandbytes) does not quantize fused 3-D expert parameters: the "
        f"routed experts of {len(layers)} MoE layers ({example} and the like, {total:,} B = "
        f"{total / 2**30:.1f} GiB) stay in {workload.dtype} and are sized so. What would shrink them: a smaller "
        "--dtype, a checkpoint stored pre-quantized in a format transformers computes from (e.g. GPT-OSS's MXFP4, "
        "DeepSeek-V3's FP8), or keeping them in host RAM where the CPU computes them (the experts_on_cpu plan)"
    )


__all__ = [
    "MoELayer",
    "expected_experts_touched",
    "expert_bytes",
    "moe_layers",
    "moe_layers_of",
    "sparse_read",
    "touched_fraction",
    "unquantized_experts_warning",
]
