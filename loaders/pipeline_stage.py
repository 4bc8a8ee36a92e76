"""One pipeline stage of a checkpoint, as a restriction of the one load: which tensors it reads, the sub-model it
builds, and the slots that make that sub-model run one stage.

A stage is not loaded by a second copy of the loader. :func:`loaders.load.load_stage` runs the ordinary
describe → place → execute (:func:`loaders.load.load_checkpoint`) with a :class:`StageRestriction`, which narrows two
of its steps and adds a last one:

- **select**: only the stage's tensors are indexed (renamed to the sub-model's layer numbers), so a stage never reads
  another stage's tensors; ``keys_read`` says what it read;
- **describe**: the sub-model is the model's own class from its own config with ``num_hidden_layers`` set to the
  stage's layer count (its own forward, masks, rotary embeddings, KV cache of its own layers), and layer
  ``first + i`` of the checkpoint is its layer ``i``; its device map is the stage plan's, renamed the same way;
- **finish**: the modules around the layers are wrapped in :class:`StageSlot`, which picks per forward what they do
  under a shared :class:`StageContext`.

The slots' two modes:

- ``layers`` mode (every stage, every micro-batch): stage 0's token embedding embeds; another stage's returns the
  hidden states received from the previous stage (extra input embeddings, GPT-2's positions, return zeros there);
  the first block after the layers (the final norm) records its input as the stage's output and the head returns
  a one-column stand-in, so no logits are computed;
- ``head`` mode (stage 0 only, when the hidden states come back around the ring): the embedding returns them,
  layers pass them through, and the final norm and head run for real.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from loaders.checkpoint.index import CheckpointIndex
from loaders.checkpoint.load_progress import LoadStats
from loaders.errors import CheckpointError
from planner.cluster import ClusterPlan, Stage
from planner.errors import PlanError
from planner.model.safetensors_header import CheckpointHeaders
from planner.model.skeleton import CheckpointModel, describe_config
from planner.placement.inputs import resolve_skeleton
from planner.types import DeviceId, Skeleton

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
            incoming = self.ctx.incoming
            assert incoming is not None, "a stage ran without the hidden states it should have received"
            return torch.zeros((*x.shape, self.hidden), dtype=incoming.dtype, device=incoming.device)
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
    """A loaded stage: the model to call, its context, what was read to build it, and what it holds.

    ``resident_bytes`` counts the weights and buffers held in memory (host RAM or GPU), tied ones once; tensors a
    stage plan leaves on disk (memory maps of the shards or of the offload folder) are not resident.
    ``stats`` is the ordinary loader's report (bytes per placement device, native linears, CPU quantization).
    """

    model: PreTrainedModel
    ctx: StageContext
    stage: Stage
    dtype: torch.dtype
    hidden_size: int
    keys_read: list[str] = field(default_factory=list)
    bytes_read: int = 0
    resident_bytes: int = 0
    stats: LoadStats = field(default_factory=LoadStats)
    device_map: dict[str, DeviceId] = field(default_factory=dict)


@dataclass(frozen=True)
class StageTensors:
    """The stage's share of the checkpoint: its tensors' headers, renamed as the stage's sub-model names them, and
    the checkpoint keys they are (what the stage reads, and nothing else)."""

    headers: CheckpointHeaders
    keys_read: list[str]
    index: CheckpointIndex


@dataclass(frozen=True)
class StageRestriction:
    """Stage ``index`` of ``plan``: what :func:`loaders.load.load_checkpoint` asks in place of the whole model.

    Built by :meth:`of`, which refuses what the stage cannot load before any file is opened. ``prefix`` is the
    decoder layers' container, ``to_local`` maps the stage's layer blocks to the sub-model's (``model.layers.5`` ->
    ``model.layers.1``), ``before``/``after`` are stage 0's blocks around the layers (every other stage holds slots
    with nothing to load there).
    """

    plan: ClusterPlan
    index: int
    prefix: str
    to_local: dict[str, str]
    before: tuple[str, ...]
    after: tuple[str, ...]

    @classmethod
    def of(cls, plan: ClusterPlan, index: int, cpu_quantization: str | None = None) -> StageRestriction:
        """The restriction to stage ``index``; ``cpu_quantization``, when given, must be the one the cluster was
        planned for (every rank loads with the plan's, so its budgets are the bytes held)."""
        if not 0 <= index < len(plan.stages):
            raise CheckpointError(f"stage {index} does not exist: the plan has {len(plan.stages)} stages")
        planned = plan.workload.cpu_quantization
        if cpu_quantization is not None and cpu_quantization != planned:
            raise PlanError(
                f"cpu_quantization={cpu_quantization!r}, but the pipeline was planned for cpu_quantization="
                f"{planned!r}: plan the cluster with the same --cpu-quantization every rank loads with"
            )
        stage = plan.stages[index]
        prefix = _layer_prefix([name for name in stage.plan.placement if name.rpartition(".")[2].isdigit()])
        to_local = {f"{prefix}.{stage.first_layer + i}": f"{prefix}.{i}" for i in range(stage.num_layers)}
        before, after = _blocks_around_layers(plan, prefix)
        if not after:
            raise CheckpointError("the model has no module after its decoder layers; cannot pipeline it")
        return cls(plan, index, prefix, to_local, tuple(before), tuple(after))

    @property
    def stage(self) -> Stage:
        return self.plan.stages[self.index]

    def folder(self, folder: str | os.PathLike | None) -> Path | None:
        """A ``stage-<index>`` folder inside ``folder``: ranks of one host sharing an offload (or quantized) folder
        never overwrite each other's files, since every stage names its layers from 0."""
        return None if folder is None else Path(folder) / f"stage-{self.index}"

    def device_map(self) -> dict[str, DeviceId]:
        """The stage plan's device map in the sub-model's names."""
        return {_rename(name, self.to_local): device for name, device in self.stage.plan.device_map.items()}

    def cpu_compute(self) -> tuple[str, ...]:
        return tuple(_rename(k, self.to_local) for k in self.stage.plan.cpu_compute)

    def select(self, root: Path, headers: CheckpointHeaders) -> StageTensors:
        """The stage's tensors: the checkpoint keys of its blocks (per the planner's skeleton), renamed."""
        return _stage_tensors(headers, resolve_skeleton(root), self.stage, self.to_local)

    def describe(self, root: Path, tensors: StageTensors, dtype: str) -> StageView:
        """The stage's sub-model on the meta device, described from its own tensors' headers. Past stage 0 the
        blocks around the layers are stage 0's: here they become slots with nothing to load, and leave the
        skeleton (and the tied pair embedding/head with them)."""
        config = AutoConfig.from_pretrained(root)
        sub = copy.deepcopy(config)
        sub.num_hidden_layers = self.stage.num_layers
        if getattr(sub, "layer_types", None):
            sub.layer_types = list(config.layer_types[self.stage.first_layer : self.stage.last_layer + 1])
        with _quiet_size_check(self.index != 0):
            described = describe_config(
                sub.to_dict(), tensors.headers, dtype, name=f"{root.name} [stage {self.index}]", source=str(root)
            )
        model = described.model
        for name in self.before:
            if not isinstance(model.get_submodule(name), torch.nn.Embedding):
                raise CheckpointError(f"{name} runs before the decoder layers and is not an embedding; cannot pipeline")
        embed = model.get_input_embeddings()
        view = StageView(
            self,
            described,
            tensors,
            StageContext(),
            int(config.hidden_size),
            getattr(torch, dtype),
            next(name for name, m in model.named_modules() if m is embed),
        )
        if self.index != 0:
            view.wrap_around_layers(model, real=False)
            skeleton = _without_blocks(described.skeleton, set(self.before) | set(self.after))
            model.all_tied_weights_keys = {}  # the tied pair (embedding, head) lives on stage 0
            view = replace(view, described=replace(described, skeleton=skeleton))
        return view


@dataclass(frozen=True)
class StageView:
    """A stage being loaded: its described sub-model (what placement fills), its tensors, and what its slots share."""

    restriction: StageRestriction
    described: CheckpointModel
    tensors: StageTensors
    ctx: StageContext
    hidden_size: int
    dtype: torch.dtype
    embed_name: str

    def wrap_around_layers(self, model: torch.nn.Module, *, real: bool) -> None:
        """Put slots in place of the blocks before and after the layers: holding the real modules (stage 0, after
        placement, so hooks installed by execution stay on them) or nothing (other stages, before placement)."""
        r, ctx, hidden = self.restriction, self.ctx, self.hidden_size
        for name in r.before:
            role = "embed" if name == self.embed_name else "extra_embed"
            model.set_submodule(name, StageSlot(role, ctx, model.get_submodule(name) if real else None, hidden))
        for k, name in enumerate(r.after):
            role = "first_after" if k == 0 else "after"
            model.set_submodule(name, StageSlot(role, ctx, model.get_submodule(name) if real else None, hidden))

    def finish(self, model: PreTrainedModel, stats: LoadStats, resident_bytes: int) -> StageModel:
        """The placed, executed sub-model made a stage: stage 0's blocks around the layers run for real (or, in
        head mode, the head), every layer passes its input through in head mode."""
        r = self.restriction
        if r.index == 0:
            self.wrap_around_layers(model, real=True)
        layers = model.get_submodule(r.prefix)
        for i in range(r.stage.num_layers):
            layers[i] = StageSlot("layer", self.ctx, layers[i], self.hidden_size)
        model.eval()
        keys, read = self.tensors.keys_read, self.tensors.index.total_bytes()
        log.info(
            "stage %d: layers %d-%d, %d tensors, %d bytes read, %d resident, by placement %s",
            r.index,
            r.stage.first_layer,
            r.stage.last_layer,
            len(keys),
            read,
            resident_bytes,
            stats.bytes_per_device,
        )
        return StageModel(
            model, self.ctx, r.stage, self.dtype, self.hidden_size, keys, read, resident_bytes, stats, r.device_map()
        )


def _layer_prefix(names: list[str]) -> str:
    prefix = names[0].rpartition(".")[0]
    if not all(n.rpartition(".")[0] == prefix for n in names):
        raise CheckpointError(f"decoder layers {names[:3]}... do not share one container; cannot pipeline them")
    return prefix


def _stage_tensors(headers: CheckpointHeaders, full: Skeleton, stage: Stage, to_local: dict[str, str]) -> StageTensors:
    """The headers of this stage's tensors only (the checkpoint keys of its blocks, per the planner's skeleton),
    renamed as the stage's sub-model names them; and the checkpoint keys they are."""
    local_of: dict[str, str] = {}
    blocks = {b.name: b for b in full.blocks}
    for block in stage.blocks:
        if full.checkpoint_keys:  # the checkpoint names its tensors otherwise than the model: the planner's keys
            keys = list(full.checkpoint_keys.get(block, ()))
        else:  # every stored key is the name of the model tensor it holds
            keys = [t.name for t in blocks[block].tensors if t.name in headers.tensors]
        for key in keys:
            local_of[key] = _rename_key(key, block, to_local.get(block, block))
    files = []
    for f in headers.files:
        kept = {local_of[k]: replace(t, name=local_of[k]) for k, t in f.tensors.items() if k in local_of}
        if kept:
            files.append(replace(f, tensors=kept))
    tensors = {name: t for f in files for name, t in f.tensors.items()}
    weight_map = {name: t.file for name, t in tensors.items()}
    sub = replace(headers, files=tuple(files), tensors=tensors, weight_map=weight_map)
    return StageTensors(sub, sorted(local_of), CheckpointIndex.from_headers(sub))


def _rename_key(key: str, block: str, local: str) -> str:
    """A checkpoint key of ``block`` as the stage names it: the block's name replaced by ``local``, however much of
    the block's leading prefix the checkpoint spells (``model.layers.5.`` or ``layers.5.``)."""
    if block == local:
        return key
    parts, local_parts = block.split("."), local.split(".")
    for skip in range(len(parts)):
        head = ".".join(parts[skip:])
        if key.startswith(head + "."):
            return ".".join(local_parts[skip:]) + key[len(head) :]
    raise CheckpointError(f"checkpoint key {key} of decoder layer {block} is not named after it; cannot pipeline it")


def _rename(name: str, to_local: dict[str, str]) -> str:
    """A module or tensor name of the full model as the stage's sub-model names it."""
    for full_name, local in to_local.items():
        if name == full_name or name.startswith(full_name + "."):
            return local + name[len(full_name) :]
    return name


def _without_blocks(skeleton: Skeleton, names: set[str]) -> Skeleton:
    blocks = tuple(b for b in skeleton.blocks if b.name not in names)
    kept = {t.name for b in blocks for t in b.tensors}
    tied = tuple(g for g in (tuple(t for t in group if t in kept) for group in skeleton.tied_groups) if len(g) > 1)
    keys = {k: v for k, v in skeleton.checkpoint_keys.items() if k not in names}
    return replace(skeleton, blocks=blocks, tied_groups=tied, checkpoint_keys=keys)


@contextmanager
def _quiet_size_check(quiet: bool) -> Iterator[None]:
    """Past stage 0 the sub-model's embedding and head are stage 0's, so the describer's "the checkpoint stores
    fewer bytes than the model needs" warning is expected there, and silenced rather than logged on every rank."""
    logger = logging.getLogger("planner.model.skeleton")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _blocks_around_layers(plan: ClusterPlan, prefix: str) -> tuple[list[str], list[str]]:
    """Stage 0's blocks before and after its layers, less those every stage holds (buffer-only, e.g. rotary)."""
    if len(plan.stages) < 2:
        raise CheckpointError("a pipeline needs at least two stages; serve a one-host plan without --pipeline")
    everywhere = set.intersection(*(set(st.plan.placement) for st in plan.stages))
    names = [b for b in plan.stages[0].plan.placement if b not in everywhere]
    first = next(i for i, b in enumerate(names) if b.startswith(prefix + "."))
    return names[:first], [b for b in names[first:] if not b.startswith(prefix + ".")]
