"""The plain data that flows through the planner: Skeleton, Hardware, Workload and Plan.

Nothing here imports torch: these types are built by the skeleton builders (which do), consumed by the
pure planning core, and serialised to JSON for the service and the loader. Sizes are always bytes (int).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

DeviceId = int | str  # GPU index (0, 1, ...), "cpu" or "disk": the values of transformers' hf_device_map

#: Bytes per element of every dtype a checkpoint or a workload may name.
DTYPE_BYTES: dict[str, float] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


class TensorSpec(NamedTuple):
    """One parameter or buffer, by its name in the transformers module tree.

    ``kind`` is ``parameter``, ``buffer`` or ``buffer_nonpersistent`` (a buffer that is not in the checkpoint but
    still occupies memory on its device), or ``packed`` (a tensor of a pre-quantized checkpoint's linear layer,
    held in its stored dtype: :mod:`planner.model.quant_config`). ``quantizable`` marks the weight of a linear layer that bitsandbytes
    would replace; everything else stays in the compute dtype under quantization. ``cpu_quantizable`` marks the
    ``[out, in]`` weight of an ``nn.Linear`` below the head, which ``cpu_quantization`` replaces (GPT-2's
    ``Conv1D`` is ``quantizable`` but not this); the head is sized by its block (:func:`planner.placement.sizing.size_blocks`).

    A NamedTuple rather than a dataclass: a 70B model has hundreds of them and MoE models hundreds of thousands,
    and building a tuple is several times cheaper than a frozen dataclass, which the planning time shows.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = "parameter"
    quantizable: bool = False
    cpu_quantizable: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Block:
    """The planner's unit of placement: a module whose tensors always share one device.

    A block is either a no-split module (a decoder layer, kept whole) or a module that directly owns tensors.
    ``layer_index`` is set on decoder layers and says which KV-cache layer the block owns.
    ``is_head`` marks the output projection, whose device also holds the logits buffer.
    ``is_embedding`` marks token embeddings, read one row per token at decode time.
    """

    name: str
    tensors: tuple[TensorSpec, ...]
    no_split: bool = False
    layer_index: int | None = None
    is_head: bool = False
    is_embedding: bool = False


@dataclass(frozen=True)
class KVGeometry:
    """What one token costs in the KV cache: per layer, K and V of ``num_kv_heads × head_dim`` each, unless the
    attention caches something else (``values_per_token``: DeepSeek's multi-head latent attention caches the
    compressed latent). Sliding-window layers keep at most ``sliding_window`` tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    #: Elements one token stores per layer when that is not ``2 × num_kv_heads × head_dim`` (0: it is).
    values_per_token: int = 0
    #: Indices of the layers that attend within a sliding window of ``sliding_window`` tokens.
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    #: What the cache holds, in words, when it is not plain per-head K and V (the plan's reasons quote it).
    layout: str = ""

    @property
    def per_token(self) -> int:
        """Elements one token stores in one (full-attention) layer's cache."""
        return self.values_per_token or 2 * self.num_kv_heads * self.head_dim

    def tokens_kept(self, layer: int, context: int) -> int:
        """Tokens layer ``layer`` keeps for a sequence of ``context`` tokens."""
        if self.sliding_window and layer in self.sliding_layers:
            return min(context, self.sliding_window)
        return context


@dataclass(frozen=True)
class StoredFormat:
    """A pre-quantized checkpoint's format as a plan reports it (from :class:`planner.model.quant_config.QuantFormat`,
    which the loader repacks from): what it is, and the kernel its CPU and disk layers run."""

    describe: str
    cpu_kernel: str


@dataclass(frozen=True)
class Skeleton:
    """The model as the planner sees it: ordered blocks, tied groups and generation geometry. Never weights."""

    name: str
    architecture: str
    model_type: str
    blocks: tuple[Block, ...]
    tied_groups: tuple[tuple[str, ...], ...] = ()
    no_split_classes: tuple[str, ...] = ()
    kv: KVGeometry | None = None
    vocab_size: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    num_attention_heads: int = 0
    #: Routed experts each token is sent to (``num_experts_per_tok``); 0 for dense models.
    experts_per_token: int = 0
    default_dtype: str = "float32"
    #: Tensor names as stored in the checkpoint when they differ from the module tree (fused MoE experts):
    #: block name -> checkpoint keys. Empty when names are identical.
    checkpoint_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Identity of the checkpoint this skeleton was read from (:mod:`planner.model.fingerprint`); None from a bare config.
    fingerprint: str | None = None
    #: The Hub commit the skeleton was read at (``None`` for local models), so a plan can name what it was made for.
    revision: str | None = None
    #: How the checkpoint stores its quantized linear layers (a ``quantization_config``); None when it stores floats.
    stored_format: StoredFormat | None = None

    def tensors(self) -> list[TensorSpec]:
        return [t for b in self.blocks for t in b.tensors]

    def block_of_tensor(self) -> dict[str, str]:
        return {t.name: b.name for b in self.blocks for t in b.tensors}


@dataclass(frozen=True)
class Device:
    """One place weights can live. ``capacity`` is what the plan may use of it, in bytes.

    ``bandwidth`` is the rate at which the device reads its own memory (bytes/s) and ``link_bandwidth`` the rate
    at which its contents reach the execution device (PCIe for ``cpu`` when GPUs compute, read speed for ``disk``).
    """

    id: DeviceId
    capacity: int
    bandwidth: float
    link_bandwidth: float

    @property
    def kind(self) -> str:
        return "gpu" if isinstance(self.id, int) else str(self.id)


@dataclass(frozen=True)
class Hardware:
    """Ordered devices: GPUs by id, then ``cpu``, then ``disk``. ``gpu_reserve`` is held back on each used GPU."""

    devices: tuple[Device, ...]
    gpu_reserve: int = 0
    source: str = "declared"
    #: Read rate of the storage the checkpoint is loaded from (bytes/s): the load-time prediction uses it.
    storage_bandwidth: float = 2.0e9
    #: Host -> GPU copy rate (bytes/s).
    link_bandwidth: float = 2.5e10
    #: How detected capacities were bounded (e.g. a container's memory limit); they open the plan's reasons.
    notes: tuple[str, ...] = ()
    #: (device, bytes) already taken off that device's capacity for a draft model
    #: (:mod:`planner.placement.draft_budget`), so that reserving for another workload gives them back first
    #: instead of taking them twice.
    draft_held: tuple[DeviceId, int] | None = None

    @property
    def gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.kind == "gpu")

    def get(self, device_id: DeviceId) -> Device | None:
        for d in self.devices:
            if d.id == device_id:
                return d
        return None


#: The most prompt tokens the serving engine prefills in one step, shared by every prefilling sequence; decode
#: rows ride along. Defined here, once, because the plan budgets activations for the largest step the engine runs:
#: the engine (``service.engine``) imports this constant rather than keeping a number of its own. The engine's
#: budget per step adapts below it (``service.engine.prefill_budget``): all of it for a wave of prompts (16
#: prompts of 128 tokens prefill in one step, vLLM's default ``max_num_batched_tokens``), less beside decoding
#: streams.
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class DraftBudget:
    """A speculative decoding draft model as the target's plan makes room for it: what the draft holds resident on
    ``device`` whatever the batch (``weights``, and ``working``: the activations of its own forwards), and its KV
    cache, ``kv_per_token`` bytes for each token of each sequence (one slot per engine slot, the served context).
    The target's plan takes these bytes off ``device`` before placing its own weights, so the draft never pushes
    the box past its memory: the target streams more instead (:mod:`planner.placement.draft_budget`)."""

    #: What drafts, in words: "int4 copy", "draft model tiny-draft".
    label: str
    device: DeviceId = "cpu"
    weights: int = 0
    working: int = 0
    kv_per_token: int = 0
    #: Most draft tokens a pass proposes (``--speculate-tokens``), for the speculative prediction.
    tokens: int = 4

    def kv_bytes(self, batch_size: int, context: int) -> int:
        return self.kv_per_token * batch_size * context

    def total(self, batch_size: int, context: int) -> int:
        return self.weights + self.working + self.kv_bytes(batch_size, context)


@dataclass(frozen=True)
class Workload:
    """What the plan must leave room for besides the weights."""

    dtype: str = "float16"
    quantization: str | None = None  # None, "int8", "nf4", "fp4"
    batch_size: int = 1
    context: int = 2048
    #: None, "int8" or "int4": the native weight-only formats of CPU and disk layers (``loaders.native.quantization``).
    cpu_quantization: str | None = None
    #: Prompt tokens one forward prefills: the serving engine's :data:`PREFILL_CHUNK`, or None for a whole-batch
    #: prefill of ``batch_size x context`` tokens at once (transformers' ``generate`` on a loaded model).
    prefill_chunk: int | None = None
    #: Speculative decoding's draft model, reserved beside the target (None: no draft model).
    draft: DraftBudget | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        draft = d.get("draft")
        return cls(**{**d, "draft": DraftBudget(**draft) if isinstance(draft, dict) else draft})

    def draft_bytes(self) -> int:
        """Bytes the draft model holds at this batch and context (0 without one)."""
        return self.draft.total(self.batch_size, self.context) if self.draft is not None else 0

    def step_tokens(self) -> int:
        """The most tokens one forward computes: a whole-batch prefill, or a chunk plus one decode row per sequence."""
        whole = self.batch_size * self.context
        return whole if self.prefill_chunk is None else min(whole, self.prefill_chunk + self.batch_size)


@dataclass
class DeviceBudget:
    """Per-device breakdown of a plan, in bytes."""

    device: DeviceId
    capacity: int
    weights: int = 0
    kv_cache: int = 0
    activations: int = 0
    reserve: int = 0
    blocks: list[str] = field(default_factory=list)
    #: Held for speculative decoding's draft model (its weights, working memory and KV): taken off the capacity
    #: before the target's blocks were placed.
    draft: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.reserve + self.draft

    @property
    def free(self) -> int:
        return self.capacity - self.total


@dataclass(frozen=True)
class ConcurrentRate:
    """The aggregate decode tokens/s the cost model predicts with ``sequences`` decoding at once on a plan's placement,
    each of :data:`~planner.placement.cost_model.CONCURRENT_CONTEXT` tokens: what that many users get together."""

    sequences: int
    tokens_per_s: float


@dataclass
class Prediction:
    """What the cost model predicts for a plan, and the model it used (stated, so it can be argued with)."""

    load_seconds: float
    decode_tokens_per_s: float  # at the workload's batch
    seconds_per_token_by_device: dict[str, float]
    cost_model: str
    #: One stream alone on the same placement (what a lone user sees); None in plans saved before it existed.
    lone_decode_tokens_per_s: float | None = None
    #: One stream with the workload's draft model, at ``speculative_acceptance`` of its tokens accepted
    #: (:mod:`planner.placement.speculative_rate`); None without a draft.
    speculative_tokens_per_s: float | None = None
    speculative_acceptance: float | None = None
    #: The aggregate decode rate at several numbers of sequences decoding at once (:data:`CONCURRENCY`); empty in
    #: plans saved before it existed.
    concurrent: list[ConcurrentRate] = field(default_factory=list)
    #: Whether the plan's disk share stays in the page cache between tokens, as the cost model took it: it fits the
    #: RAM the plan leaves free. The loader keeps the disk pages it reads where true and gives each block's back
    #: after use where false, so that the plan and the run agree. None without a disk share (or in older plans).
    disk_cached: bool | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prediction:
        fields = {k: v for k, v in d.items() if k != "concurrent"}
        return cls(**fields, concurrent=[ConcurrentRate(**c) for c in d.get("concurrent", [])])

    def concurrent_rate(self, sequences: int) -> float | None:
        """The predicted aggregate decode tokens/s of ``sequences`` at once, if the plan states it."""
        return next((c.tokens_per_s for c in self.concurrent if c.sequences == sequences), None)


@dataclass
class Plan:
    """The planner's answer. Serialises to JSON and back without loss; the loader obeys it unchanged."""

    model: str
    architecture: str
    strategy: str
    workload: Workload
    device_map: dict[str, DeviceId]
    budgets: list[DeviceBudget]
    offloaded_bytes: int
    prediction: Prediction
    warnings: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    #: Block name -> device: the unmerged placement, for readers that want per-layer detail.
    placement: dict[str, DeviceId] = field(default_factory=dict)
    #: The checkpoint this plan was made for (:mod:`planner.model.fingerprint`); None when planned from a bare config.
    #: The loader refuses to apply the plan to a checkpoint with another fingerprint.
    fingerprint: str | None = None
    #: The Hub commit of the checkpoint this plan was made for (``None`` for local models); the loader checks it.
    revision: str | None = None
    #: Device-map keys on ``cpu`` whose modules compute on the CPU, where they live, while GPUs compute the rest:
    #: routed experts (``model.layers.N.mlp.experts``) and layers that did not fit the GPUs. A ``cpu`` entry not
    #: listed is streamed to the first GPU, as in transformers (:mod:`planner.placement.sub_layer`, :mod:`loaders.run.cpu_experts`).
    cpu_compute: list[str] = field(default_factory=list)
    #: Device label (``GPU 0``, ``cpu``, ``disk``) -> the kernel its layers run on (:mod:`planner.placement.tier_kernels`).
    kernels: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for b, src in zip(d["budgets"], self.budgets):
            b["total"] = src.total
            b["free"] = src.free
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        budgets = []
        for b in d["budgets"]:
            b = {k: v for k, v in b.items() if k not in ("total", "free")}
            budgets.append(DeviceBudget(**b))
        return cls(
            model=d["model"],
            architecture=d["architecture"],
            strategy=d["strategy"],
            workload=Workload.from_dict(d["workload"]),
            device_map=dict(d["device_map"]),
            budgets=budgets,
            offloaded_bytes=int(d["offloaded_bytes"]),
            prediction=Prediction.from_dict(d["prediction"]),
            warnings=list(d.get("warnings", [])),
            reasons=list(d.get("reasons", [])),
            placement=dict(d.get("placement", {})),
            fingerprint=d.get("fingerprint"),
            revision=d.get("revision"),
            cpu_compute=list(d.get("cpu_compute", [])),
            kernels=dict(d.get("kernels", {})),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def budget(self, device: DeviceId) -> DeviceBudget | None:
        for b in self.budgets:
            if b.device == device:
                return b
        return None
