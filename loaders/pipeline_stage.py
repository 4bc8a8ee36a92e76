"""One pipeline stage of a checkpoint: a real transformers model holding only this stage's layers and tensors.

The stage is built from the model's own config with ``num_hidden_layers`` set to the stage's layer count, so it is
the model's own class running its own forward (masks, rotary embeddings, KV cache of its own layers), and layer
``first + i`` of the checkpoint is loaded into its layer ``i``. The modules around the layers are wrapped in
:class:`StageSlot`, which picks per forward what they do under a shared :class:`StageContext`:

- ``layers`` mode (every stage, every micro-batch): stage 0's token embedding embeds; another stage's returns the
  hidden states received from the previous stage (extra input embeddings, GPT-2's positions, return zeros there);
  the first block after the layers (the final norm) records its input as the stage's output and the head returns
  a one-column stand-in, so no logits are computed;
- ``head`` mode (stage 0 only, when the hidden states come back around the ring): the embedding returns them,
  layers pass them through, and the final norm and head run for real.

Tensors are read straight from their byte ranges in the shards (:class:`~loaders.safetensors_index.ShardEntry`),
so a stage never reads another stage's tensors; ``keys_read`` and ``resident_bytes`` say what it read and holds.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from loaders.checkpoint_layout import to_torch_index
from loaders.errors import CheckpointError
from loaders.model_tensors import init_non_persistent_buffers, non_persistent_buffers, set_tensor
from loaders.safetensors_index import CheckpointIndex
from planner.checkpoint_keys import tensor_source
from planner.cluster import ClusterPlan, Stage
from planner.fingerprint import check_plan_fingerprint, checkpoint_fingerprint

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    """What the stage's slots share during one forward: the mode, the hidden states in, and the ones out."""

    mode: str = "layers"  # "layers" | "head"
    incoming: torch.Tensor | None = None
    outgoing: torch.Tensor | None = None


class StageSlot(torch.nn.Module):
    """A module around the decoder layers (or a layer) whose behaviour depends on the stage and the mode."""

    def __init__(self, role: str, ctx: StageContext, real: torch.nn.Module | None, hidden: int):
        super().__init__()
        self.role = role  # "embed" | "extra_embed" | "layer" | "first_after" | "after"
        self.ctx = ctx
        self.real = real
        self.hidden = hidden

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        head = self.ctx.mode == "head"
        if self.role == "embed":
            if self.real is not None and not head:
                return self.real(x)
            assert self.ctx.incoming is not None, "a stage ran without the hidden states it should have received"
            return self.ctx.incoming
        if self.role == "extra_embed":
            if self.real is not None and not head:
                return self.real(x)
            return torch.zeros((*x.shape, self.hidden), dtype=self.ctx.incoming.dtype)  # type: ignore[union-attr]
        if self.role == "layer":
            if self.real is not None and not head:
                return self.real(x, *args, **kwargs)
            return x
        if head:
            assert self.real is not None, "only stage 0 computes the head"
            return self.real(x, *args, **kwargs)
        if self.role == "first_after":
            self.ctx.outgoing = x
            return x
        return x[..., :1]


@dataclass
class StageModel:
    """A loaded stage: the model to call, its context, and what was read to build it."""

    model: PreTrainedModel
    ctx: StageContext
    stage: Stage
    dtype: torch.dtype
    hidden_size: int
    keys_read: list[str] = field(default_factory=list)
    bytes_read: int = 0

    @property
    def resident_bytes(self) -> int:
        """Bytes this stage holds: parameters and buffers (rotary frequencies included), tied ones once."""
        seen: set[int] = set()
        total = 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.device.type != "meta" and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total


def _layer_prefix(names: list[str]) -> str:
    prefix = names[0].rpartition(".")[0]
    if not all(n.rpartition(".")[0] == prefix for n in names):
        raise CheckpointError(f"decoder layers {names[:3]}... do not share one container; cannot pipeline them")
    return prefix


def load_stage(checkpoint: str | Path, plan: ClusterPlan, index: int) -> StageModel:
    """Load stage ``index`` of ``plan`` from the checkpoint directory, reading only that stage's tensors."""
    root = Path(checkpoint)
    ckpt = CheckpointIndex.open(root)
    check_plan_fingerprint(plan.fingerprint, checkpoint_fingerprint(ckpt.headers), str(root))
    if not 0 <= index < len(plan.stages):
        raise CheckpointError(f"stage {index} does not exist: the plan has {len(plan.stages)} stages")
    stage = plan.stages[index]
    elsewhere = sorted({str(d) for d in stage.plan.device_map.values() if d != "cpu"})
    if elsewhere:  # a stage is loaded into host memory; its plan must say so, or the plan would be ignored
        raise CheckpointError(
            f"stage {index}'s plan places blocks on device(s) {', '.join(elsewhere)}, and a pipeline stage loads into "
            "host memory only for now; plan each host for its CPU memory (--max-memory cpu=SIZE, no --gpus)"
        )
    dtype = getattr(torch, plan.workload.dtype)
    config = AutoConfig.from_pretrained(root)
    sub = copy.deepcopy(config)
    n = stage.num_layers
    sub.num_hidden_layers = n
    if getattr(sub, "layer_types", None):
        sub.layer_types = list(config.layer_types[stage.first_layer : stage.last_layer + 1])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(sub, dtype=dtype)
    model.eval()
    hidden = int(config.hidden_size)
    ctx = StageContext()

    full_layers = [f"{name}" for name in stage.plan.placement if name.rpartition(".")[2].isdigit()]
    prefix = _layer_prefix(full_layers)
    # Module names of the stage model that hold layers, and the checkpoint layer each maps to.
    rename = {f"{prefix}.{i}": f"{prefix}.{stage.first_layer + i}" for i in range(n)}
    embed = model.get_input_embeddings()
    embed_name = next(name for name, m in model.named_modules() if m is embed)
    layer_container = model.get_submodule(prefix)
    before_names, after_names = _blocks_around_layers(plan, prefix)
    for name in before_names:
        if not isinstance(model.get_submodule(name), torch.nn.Embedding):
            raise CheckpointError(f"{name} runs before the decoder layers and is not an embedding; cannot pipeline")
        real = model.get_submodule(name) if index == 0 else None
        model.set_submodule(name, StageSlot("embed" if name == embed_name else "extra_embed", ctx, real, hidden))
    for i in range(n):
        layer_container[i] = StageSlot("layer", ctx, layer_container[i], hidden)
    if not after_names:
        raise CheckpointError("the model has no module after its decoder layers; cannot pipeline it")
    for k, name in enumerate(after_names):
        real = model.get_submodule(name) if index == 0 else None
        model.set_submodule(name, StageSlot("first_after" if k == 0 else "after", ctx, real, hidden))

    # Read this stage's tensors, and only them, from their byte ranges in the shards.
    keys_read: list[str] = []
    bytes_read = 0
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    persistent = {n for n, _ in model.named_parameters()} | {
        n for n, _ in model.named_buffers() if n not in non_persistent_buffers(model)
    }
    base = getattr(model, "base_model_prefix", "")
    shapes = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    for name in sorted(persistent):
        plain = name.replace(".real.", ".")
        ckpt_name = _checkpoint_name(plain, rename)
        source = tensor_source(ckpt_name, shapes[name], ckpt, base)  # identity, no base prefix, or fused experts
        if source is None:
            if plain in tied:
                continue
            raise CheckpointError(f"stage {index}: tensor {ckpt_name} is not in the checkpoint {root}")
        value = None
        for piece in source.pieces:
            entry = ckpt[piece.key]
            with open(entry.file, "rb") as f:
                f.seek(entry.start)
                raw = bytearray(f.read(entry.end - entry.start))
            t = torch.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape) if raw else torch.empty(entry.shape)
            t = t.to(dtype) if t.is_floating_point() else t
            if source.is_plain:
                value = t
            else:
                value = torch.empty(shapes[name], dtype=t.dtype) if value is None else value
                value[to_torch_index(piece.index)] = t
            keys_read.append(piece.key)
            bytes_read += entry.end - entry.start
        assert value is not None
        set_tensor(model, name, value)
    init_non_persistent_buffers(model, {})
    if index == 0:
        _tie(model)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"stage {index}: tensors left without data after loading: {left[:5]}")
    log.info(
        "stage %d: layers %d-%d, %d tensors, %d bytes read",
        index,
        stage.first_layer,
        stage.last_layer,
        len(keys_read),
        bytes_read,
    )
    return StageModel(model, ctx, stage, dtype, hidden, keys_read, bytes_read)


def _blocks_around_layers(plan: ClusterPlan, prefix: str) -> tuple[list[str], list[str]]:
    """Stage 0's blocks before and after its layers, less those every stage holds (buffer-only, e.g. rotary)."""
    if len(plan.stages) < 2:
        raise CheckpointError("a pipeline needs at least two stages; serve a one-host plan without --pipeline")
    everywhere = set.intersection(*(set(st.plan.placement) for st in plan.stages))
    names = [b for b in plan.stages[0].plan.placement if b not in everywhere]
    first = next(i for i, b in enumerate(names) if b.startswith(prefix + "."))
    return names[:first], [b for b in names[first:] if not b.startswith(prefix + ".")]


def _checkpoint_name(name: str, rename: dict[str, str]) -> str:
    for stage_name, ckpt_name in rename.items():
        if name.startswith(stage_name + "."):
            return ckpt_name + name[len(stage_name) :]
    return name


def _tie(model: PreTrainedModel) -> None:
    """Re-tie tied weights through the slots (``lm_head.real.weight`` is ``wte.real.weight``)."""
    for target, source in (getattr(model, "all_tied_weights_keys", {}) or {}).items():
        src = _slot_name(model, source)
        dst = _slot_name(model, target)
        src_mod, _, src_leaf = src.rpartition(".")
        dst_mod, _, dst_leaf = dst.rpartition(".")
        setattr(model.get_submodule(dst_mod), dst_leaf, getattr(model.get_submodule(src_mod), src_leaf))


def _slot_name(model: torch.nn.Module, name: str) -> str:
    mod, _, leaf = name.rpartition(".")
    m = model.get_submodule(mod)
    return f"{mod}.real.{leaf}" if isinstance(m, StageSlot) else name
