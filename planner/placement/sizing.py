"""What each block costs for a workload: its weights in the run dtype or quantization, its KV cache, and the
transient memory generation needs on each device that computes.

The byte counts are those bitsandbytes and transformers really allocate (checked in tests/planner):
- int8 (LLM.int8, ``Linear8bitLt``): one byte per weight plus one float32 scale per output row (``SCB``);
- nf4 / fp4 (``Linear4bit``): two weights per byte plus one float32 ``absmax`` per block of 64 weights, and a
  small per-tensor quant state;
- everything that is not the weight of a linear layer (embeddings, norms, biases, the output head) stays in the
  compute dtype, as transformers' integration does.

The native CPU formats (``cpu_quantization``, :mod:`loaders.native.quantization`) are sized by :func:`cpu_quantized_layout`,
the one definition of their layouts, which the loader allocates by:
- int8: int8 ``[N, G*64]`` (each row of K inputs zero-padded to G = ceil(K/64) groups) plus one float32 scale per
  row;
- int4: uint8 ``[N, G*32]`` (two codes per byte) plus one float16 scale per row and group;
- every ``nn.Linear`` weight is replaced, the output head included (int8 under int4; a tied head gets its own
  quantized copy, and the embedding keeps its weight); biases, norms and embeddings stay in the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.errors import PlanError
from planner.model.moe import expert_bytes, moe_layers, sparse_read
from planner.types import DTYPE_BYTES, FLOAT_DTYPES, Block, Skeleton, TensorSpec, Workload

QUANTIZATIONS = ("int8", "nf4", "fp4")
CPU_QUANTIZATIONS = ("int8", "int4")
#: Inputs per group of the native formats: int8 rows pad to whole groups, int4 keeps one scale per group.
CPU_QUANT_GROUP = 64
RUN_DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "torch.float32": "float32",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "torch.float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
}
_QUANT_ALIASES = {
    "int8": "int8",
    "8bit": "int8",
    "llm.int8": "int8",
    "bnb-int8": "int8",
    "nf4": "nf4",
    "4bit": "nf4",
    "bnb-nf4": "nf4",
    "fp4": "fp4",
    "bnb-fp4": "fp4",
}
BNB_4BIT_BLOCKSIZE = 64
BNB_4BIT_STATE_BYTES = 64  # per-tensor quant state besides absmax (the 16-entry code table, shape, dtype)
LOGITS_COPIES = 2  # generate() upcasts the last position's logits to float32 and softmaxes/argmaxes a copy


def normalize_dtype(dtype: str | None, default: str) -> str:
    """``bf16``/``bfloat16``/``torch.bfloat16`` -> ``bfloat16``. ``None`` or ``auto`` takes the checkpoint's."""
    if dtype is None or str(dtype).lower() == "auto":
        dtype = default
    key = str(dtype).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise PlanError(f"unknown dtype {dtype!r}; use one of fp32, fp16, bf16 (or float32, float16, bfloat16)")
    return _DTYPE_ALIASES[key]


def normalize_quantization(q: str | None) -> str | None:
    if q is None or str(q).strip().lower() in ("", "none", "no"):
        return None
    key = str(q).strip().lower()
    if key not in _QUANT_ALIASES:
        raise PlanError(f"unknown quantization {q!r}; use one of int8, nf4, fp4 (bitsandbytes), or none")
    return _QUANT_ALIASES[key]


def normalize_cpu_quantization(q: str | None) -> str | None:
    if q is None or str(q).strip().lower() in ("", "none", "no"):
        return None
    key = str(q).strip().lower()
    if key not in CPU_QUANTIZATIONS:
        raise PlanError(
            f"unknown cpu_quantization {q!r}; use int8 or int4 (the native CPU formats), or none. "
            "bitsandbytes' int8, nf4 and fp4 for GPU layers are --quantization."
        )
    return key


@dataclass(frozen=True)
class QuantizedLayout:
    """The two tensors a native CPU-quantized linear layer holds instead of its ``[out, in]`` weight."""

    qweight_shape: tuple[int, int]
    qweight_dtype: str
    scales_shape: tuple[int, ...]
    scales_dtype: str

    @property
    def nbytes(self) -> int:
        return (
            math.prod(self.qweight_shape) * DTYPE_BYTES[self.qweight_dtype]
            + math.prod(self.scales_shape) * DTYPE_BYTES[self.scales_dtype]
        )


def cpu_quantized_layout(out_features: int, in_features: int, scheme: str) -> QuantizedLayout:
    """What ``cpu_quantization=scheme`` stores for an ``[out_features, in_features]`` weight (see the module
    docstring); the loader allocates exactly these shapes."""
    groups = (in_features + CPU_QUANT_GROUP - 1) // CPU_QUANT_GROUP
    if scheme == "int8":
        return QuantizedLayout((out_features, groups * CPU_QUANT_GROUP), "int8", (out_features,), "float32")
    if scheme == "int4":
        return QuantizedLayout(
            (out_features, groups * CPU_QUANT_GROUP // 2), "uint8", (out_features, groups), "float16"
        )
    raise PlanError(f"unknown cpu_quantization {scheme!r}; use one of {', '.join(CPU_QUANTIZATIONS)}")


def tensor_bytes(t: TensorSpec, workload: Workload) -> int:
    """Bytes ``t`` occupies once loaded for ``workload``.

    Parameters and persistent buffers in a floating dtype take the run dtype; non-persistent buffers keep the
    dtype the model computes them in (rotary frequencies stay float32); integer tensors keep theirs.
    """
    if t.dtype not in DTYPE_BYTES:
        raise PlanError(f"tensor {t.name} has unsupported dtype {t.dtype!r}")
    n = math.prod(t.shape)
    if t.kind == "packed":  # a pre-quantized checkpoint's tensor: held as stored (planner.model.quant_config)
        return int(n * DTYPE_BYTES[t.dtype])
    if workload.cpu_quantization and t.cpu_quantizable and len(t.shape) == 2:
        return cpu_quantized_layout(int(t.shape[0]), int(t.shape[1]), workload.cpu_quantization).nbytes
    if workload.quantization and t.quantizable and len(t.shape) == 2:
        if workload.quantization == "int8":
            return n + int(t.shape[0]) * 4
        return math.ceil(n / 2) + math.ceil(n / BNB_4BIT_BLOCKSIZE) * 4 + BNB_4BIT_STATE_BYTES
    if t.dtype in FLOAT_DTYPES and t.kind != "buffer_nonpersistent":
        return int(n * DTYPE_BYTES[workload.dtype])
    return int(n * DTYPE_BYTES[t.dtype])


def head_cpu_quantized_bytes(skeleton: Skeleton, block: Block, workload: Workload) -> int:
    """Bytes ``cpu_quantization`` adds to (or saves in) the output head's block, beside :func:`tensor_bytes`.

    The head is an ``nn.Linear`` the loader quantizes like the others, but int8 under int4 too. Its own weight is
    replaced (the difference is returned); a head tied to the embedding has no tensor of its own in the skeleton,
    and gets a quantized copy while the embedding keeps its weight (the copy's bytes are returned)."""
    if not workload.cpu_quantization or not block.is_head:
        return 0
    scheme = "int8"
    own = [t for t in block.tensors if t.name == f"{block.name}.weight" and len(t.shape) == 2]
    if own:
        t = own[0]
        return cpu_quantized_layout(int(t.shape[0]), int(t.shape[1]), scheme).nbytes - tensor_bytes(t, workload)
    weight = f"{block.name}.weight"
    specs = {t.name: t for t in skeleton.tensors()} if skeleton.tied_groups else {}
    for group in skeleton.tied_groups:
        if weight in group:
            source = next((specs[n] for n in group if n in specs and len(specs[n].shape) == 2), None)
            if source is not None:
                return cpu_quantized_layout(int(source.shape[0]), int(source.shape[1]), scheme).nbytes
    return 0


def block_bytes(block: Block, workload: Workload, skeleton: Skeleton | None = None) -> int:
    """A block's weights for ``workload``; ``skeleton`` (for the tied head under ``cpu_quantization``)."""
    extra = head_cpu_quantized_bytes(skeleton, block, workload) if skeleton is not None else 0
    return sum([tensor_bytes(t, workload) for t in block.tensors]) + extra


def kv_bytes_per_layer(skeleton: Skeleton, workload: Workload, layer: int | None = None) -> int:
    """K and V for ``batch_size × context`` tokens of one layer (``layer``: its index, for a sliding-window layer,
    which keeps at most its window), in the compute dtype. Latent caches (MLA) store what
    :class:`~planner.types.KVGeometry` says they store."""
    if skeleton.kv is None:
        return 0
    per_token = skeleton.kv.per_token * DTYPE_BYTES[workload.dtype]
    tokens = workload.context if layer is None else skeleton.kv.tokens_kept(layer, workload.context)
    return int(per_token * workload.batch_size * tokens)


def kv_explanation(skeleton: Skeleton, workload: Workload) -> str | None:
    """The plan's sentence on how the KV cache was sized, when it is not plain per-head K and V at full context."""
    kv = skeleton.kv
    if kv is None or not (kv.layout or kv.sliding_layers):
        return None
    per_layer = kv_bytes_per_layer(skeleton, workload)
    parts = [
        f"KV cache for batch {workload.batch_size} x context {workload.context}: "
        f"{kv.per_token} values per token per layer ({per_layer:,} B per full layer)"
    ]
    if kv.layout:
        parts.append(kv.layout)
    if kv.sliding_layers:
        parts.append(
            f"{len(kv.sliding_layers)} of {kv.num_layers} layers attend within a sliding window of {kv.sliding_window} "
            f"tokens and are sized at min(context, window) = {min(workload.context, kv.sliding_window)} tokens"
        )
    return "; ".join(parts)


def activation_bytes(skeleton: Skeleton, workload: Workload) -> int:
    """Peak transient memory of one decoder layer during the largest forward the workload runs: a whole-batch
    prefill of ``batch_size × context`` tokens, or the serving engine's step (its prefill chunk plus one decode row
    per sequence; :meth:`~planner.types.Workload.step_tokens`).

    Counted per token: the residual stream, the normed input and the attention output (3 × hidden), the query
    and the new K/V (hidden + 2 × kv_heads × head_dim), and the MLP's gate and up projections (2 × intermediate),
    all in the compute dtype. Attention scores are not materialised (SDPA's fused kernels), which is what
    transformers uses by default on GPUs.
    """
    hidden = skeleton.hidden_size
    kv_width = skeleton.kv.per_token if skeleton.kv else 2 * hidden
    per_token = 4 * hidden + kv_width + 2 * max(skeleton.intermediate_size, 0)
    return int(per_token * workload.step_tokens() * DTYPE_BYTES[workload.dtype])


def logits_bytes(skeleton: Skeleton, workload: Workload) -> int:
    """The last position's logits (``batch × vocab``, float32) and the copy generation makes of them."""
    return int(workload.batch_size * skeleton.vocab_size * 4 * LOGITS_COPIES)


@dataclass(frozen=True)
class SizedBlock:
    """A block with its costs for one workload: what the placement algorithm works on."""

    name: str
    weight: int
    kv: int
    is_head: bool
    is_embedding: bool
    is_layer: bool
    #: Bytes a decode step reads when the block computes where it lives: the whole weight, except an embedding
    #: (one row per sequence) and routed experts (only those the batch's tokens are sent to: :mod:`planner.model.moe`).
    read_per_token: int
    #: Bytes a decode step copies when the block is streamed to the GPU: the whole block (the streamer copies every
    #: tensor of it, touched or not), except an embedding's rows. Defaults to ``read_per_token``.
    stream_per_token: int = -1
    #: Bytes of routed experts inside this block.
    expert_weight: int = 0
    #: Computes on the device it is placed on even while GPUs compute the rest (routed experts kept on the CPU, or
    #: a layer the CPU computes where it lives), instead of being streamed to the first GPU; its KV cache is there.
    in_place: bool = False
    #: Index of the skeleton block this item is (part of).
    block: int = -1
    #: Output rows of its matrices (each one dot product per token at decode); 0 for an embedding that is not the
    #: head (a lookup, no product). The calibrated cost model charges a fixed cost per row (:mod:`planner.placement.cost_model`).
    matrix_rows: int = 0

    @property
    def streamed(self) -> int:
        return self.read_per_token if self.stream_per_token < 0 else self.stream_per_token


def size_blocks(skeleton: Skeleton, workload: Workload) -> list[SizedBlock]:
    """One item per skeleton block. A MoE layer reads its routed experts sparsely when it computes in place."""
    kv_layer = kv_bytes_per_layer(skeleton, workload)
    out = []
    sized: dict[tuple, int] = {}  # (shape, dtype, kind, quantizable) -> bytes: layers repeat the same tensors
    experts = {m.layer: m for m in moe_layers(skeleton)}
    sliding = set(skeleton.kv.sliding_layers) if skeleton.kv is not None and skeleton.kv.sliding_window else set()
    for i, b in enumerate(skeleton.blocks):
        w = 0
        for t in b.tensors:
            key = t[1:]
            n = sized.get(key)
            if n is None:
                n = sized[key] = tensor_bytes(t, workload)
            w += n
        w += head_cpu_quantized_bytes(skeleton, b, workload)
        if b.is_embedding and not b.is_head:
            rows = max(b.tensors[0].shape[0], 1) if b.tensors and b.tensors[0].shape else 1
            read = int(w / rows) * workload.batch_size
        else:
            read = w
        stream, expert_w = read, 0
        moe = experts.get(b.name)
        if moe is not None:
            expert_w = expert_bytes(moe, lambda t: tensor_bytes(t, workload))[0]
            read = w - expert_w + sparse_read(expert_w, moe, workload.batch_size)
        out.append(
            SizedBlock(
                name=b.name,
                weight=w,
                kv=(kv_layer if b.layer_index not in sliding else kv_bytes_per_layer(skeleton, workload, b.layer_index))
                if b.layer_index is not None
                else 0,
                is_head=b.is_head,
                is_embedding=b.is_embedding,
                is_layer=b.layer_index is not None,
                read_per_token=read,
                stream_per_token=stream,
                expert_weight=expert_w,
                block=i,
                matrix_rows=0
                if b.is_embedding and not b.is_head
                else sum(t.shape[0] for t in b.tensors if len(t.shape) == 2),
            )
        )
    return out


def split_experts(skeleton: Skeleton, items: list[SizedBlock], first: int = 0) -> list[SizedBlock]:
    """The items with every MoE layer cut in two: the layer without its routed experts (attention, norms, router,
    shared experts: read whole every step), then the routed experts as their own item, which computes where it is
    placed (``in_place``) and reads only the experts a step touches. The device map names the second part by its
    module path (``model.layers.N.mlp.experts``), as transformers' format allows. Layers before layer index
    ``first`` stay whole."""
    experts = {m.layer: m for m in moe_layers(skeleton) if m.layer_index >= first}
    out: list[SizedBlock] = []
    for it in items:
        moe = experts.get(it.name)
        if moe is None or it.expert_weight <= 0:
            out.append(it)
            continue
        rest = it.weight - it.expert_weight
        sparse = it.read_per_token - rest
        out.append(replace(it, weight=rest, read_per_token=rest, stream_per_token=rest, expert_weight=0))
        out.append(
            SizedBlock(
                name=moe.experts,
                weight=it.expert_weight,
                kv=0,
                is_head=False,
                is_embedding=False,
                is_layer=False,
                read_per_token=sparse,
                stream_per_token=it.expert_weight,
                expert_weight=it.expert_weight,
                in_place=True,
                block=it.block,
            )
        )
    return out
