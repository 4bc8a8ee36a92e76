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

The stage loads through the ordinary loader: its sub-model is described by the planner from the headers of its
own tensors only (renamed to the sub-model's layer numbers), placed by :func:`loaders.checkpoint.placement.place` on the devices
its stage plan names (GPUs, CPU, disk) and made to run there by :func:`loaders.run.execution.apply_execution` (streaming
and readahead of disk blocks, CPU quantization, native kernels). No other stage's tensor is in its index, so a stage
never reads another stage's tensors; ``keys_read`` and ``resident_bytes`` say what it read and holds.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from loaders.checkpoint.index import CheckpointIndex
from loaders.checkpoint.load_progress import LoadStats, ProgressReporter
from loaders.checkpoint.placement import place
from loaders.checkpoint.residency import CPU_RESIDENCY_CHOICES, lock_resident
from loaders.errors import CheckpointError
from loaders.native.linear import CPU_KERNEL_CHOICES
from loaders.run.execution import apply_execution
from planner.cluster import ClusterPlan, Stage
from planner.errors import PlanError
from planner.model.fingerprint import check_plan_fingerprint, checkpoint_fingerprint
from planner.model.safetensors_header import CheckpointHeaders
from planner.model.skeleton import describe_config
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


def _layer_prefix(names: list[str]) -> str:
    prefix = names[0].rpartition(".")[0]
    if not all(n.rpartition(".")[0] == prefix for n in names):
        raise CheckpointError(f"decoder layers {names[:3]}... do not share one container; cannot pipeline them")
    return prefix


def load_stage(
    checkpoint: str | Path,
    plan: ClusterPlan,
    index: int,
    *,
    offload_folder: str | os.PathLike | None = None,
    cpu_kernels: str = "auto",
    cpu_quantization: str | None = None,
    cpu_quantized_dir: str | os.PathLike | None = None,
    cpu_residency: str = "lock",
) -> StageModel:
    """Load stage ``index`` of ``plan`` from the checkpoint directory, reading only that stage's tensors, through
    the ordinary loader (:func:`loaders.checkpoint.placement.place` then :func:`loaders.run.execution.apply_execution`): each of
    its blocks lands on the device its stage plan names (a GPU, the CPU, or disk, streamed as in one process), CPU
    layers are quantized (``cpu_quantization``, which must be the plan's) and run on the native kernels
    (``cpu_kernels``) as a one-host load does.

    ``offload_folder`` and ``cpu_quantized_dir`` get a ``stage-<index>`` folder each, so ranks of one host sharing
    a folder never overwrite each other's files (a stage names its layers from 0, as its sub-model does).
    """
    if cpu_kernels not in CPU_KERNEL_CHOICES:
        raise PlanError(f"cpu_kernels={cpu_kernels!r} is not one of {', '.join(CPU_KERNEL_CHOICES)}.")
    if cpu_residency not in CPU_RESIDENCY_CHOICES:
        raise PlanError(f"cpu_residency={cpu_residency!r} is not one of {', '.join(CPU_RESIDENCY_CHOICES)}.")
    root = Path(checkpoint)
    ckpt = CheckpointIndex.open(root)
    check_plan_fingerprint(plan.fingerprint, checkpoint_fingerprint(ckpt.headers), str(root))
    if not 0 <= index < len(plan.stages):
        raise CheckpointError(f"stage {index} does not exist: the plan has {len(plan.stages)} stages")
    planned_quant = plan.workload.cpu_quantization
    if cpu_quantization is not None and cpu_quantization != planned_quant:
        raise PlanError(
            f"cpu_quantization={cpu_quantization!r}, but the pipeline was planned for cpu_quantization="
            f"{planned_quant!r}: plan the cluster with the same --cpu-quantization every rank loads with"
        )
    cpu_quantization = planned_quant
    stage = plan.stages[index]
    dtype = getattr(torch, plan.workload.dtype)
    t0 = time.perf_counter()

    layer_blocks = [name for name in stage.plan.placement if name.rpartition(".")[2].isdigit()]
    prefix = _layer_prefix(layer_blocks)
    # The stage's sub-model names its layers from 0: stage name -> checkpoint block name, and back.
    to_local = {f"{prefix}.{stage.first_layer + i}": f"{prefix}.{i}" for i in range(stage.num_layers)}
    config = AutoConfig.from_pretrained(root)
    sub = copy.deepcopy(config)
    sub.num_hidden_layers = stage.num_layers
    if getattr(sub, "layer_types", None):
        sub.layer_types = list(config.layer_types[stage.first_layer : stage.last_layer + 1])
    full = resolve_skeleton(root)
    headers, keys_read = _stage_headers(ckpt.headers, full, stage, to_local)
    with _quiet_size_check(index != 0):
        described = describe_config(
            sub.to_dict(), headers, plan.workload.dtype, name=f"{root.name} [stage {index}]", source=str(root)
        )
    model = described.model
    hidden = int(config.hidden_size)
    ctx = StageContext()
    before_names, after_names = _blocks_around_layers(plan, prefix)
    if not after_names:
        raise CheckpointError("the model has no module after its decoder layers; cannot pipeline it")
    embed = model.get_input_embeddings()
    embed_name = next(name for name, m in model.named_modules() if m is embed)
    for name in before_names:
        if not isinstance(model.get_submodule(name), torch.nn.Embedding):
            raise CheckpointError(f"{name} runs before the decoder layers and is not an embedding; cannot pipeline")
    local_map = {_rename(name, to_local): device for name, device in stage.plan.device_map.items()}
    skeleton = described.skeleton
    if index != 0:  # the blocks around the layers are stage 0's: here they are slots with nothing to load
        for name in before_names:
            model.set_submodule(name, StageSlot("embed" if name == embed_name else "extra_embed", ctx, None, hidden))
        for k, name in enumerate(after_names):
            model.set_submodule(name, StageSlot("first_after" if k == 0 else "after", ctx, None, hidden))
        skeleton = _without_blocks(skeleton, set(before_names) | set(after_names))
        model.all_tied_weights_keys = {}  # the tied pair (embedding, head) lives on stage 0
    described = replace(described, model=model, skeleton=skeleton)

    reporter = ProgressReporter(sum(ckpt[k].nbytes for k in keys_read), None, show_bar=False)
    try:
        placed = place(
            described,
            CheckpointIndex.from_headers(headers),
            local_map,
            dtype,
            reporter,
            model_path=root,
            offload_folder=_stage_folder(offload_folder, index),
            cpu_compute=tuple(_rename(k, to_local) for k in stage.plan.cpu_compute),
            lock_resident=cpu_residency == "lock",
        )
        disk = {id(t) for n, t in _named_tensors(model) if placed.tensor_devices.get(n) == "disk"}
        executed = apply_execution(
            placed,
            cpu_kernels,
            cpu_quantization=cpu_quantization,
            cpu_quantized_dir=_stage_folder(cpu_quantized_dir, index),
            checkpoint_files=[(f.path, f.size, f.mtime_ns) for f in ckpt.files],
        )
        stats = placed.stats
        stats.native_linears = executed.native_linears
        stats.native_attention = executed.native_attention
        stats.cpu_quantization = executed.cpu_quantization
        if cpu_residency == "lock":
            stats.residency = lock_resident(model, local_map)
        reporter.close()
    except BaseException:
        reporter.fail()
        raise

    # Now the slots: stage 0's blocks around the layers run for real (or, in head mode, the head), every layer
    # passes its input through in head mode. Hooks installed by execution stay on the wrapped modules.
    if index == 0:
        for name in before_names:
            real = model.get_submodule(name)
            model.set_submodule(name, StageSlot("embed" if name == embed_name else "extra_embed", ctx, real, hidden))
        for k, name in enumerate(after_names):
            model.set_submodule(
                name, StageSlot("first_after" if k == 0 else "after", ctx, model.get_submodule(name), hidden)
            )
    layer_container = model.get_submodule(prefix)
    for i in range(stage.num_layers):
        layer_container[i] = StageSlot("layer", ctx, layer_container[i], hidden)
    model.eval()
    stats.seconds = time.perf_counter() - t0
    bytes_read = sum(ckpt[k].nbytes for k in keys_read)
    resident = _resident_bytes(model, disk)
    log.info(
        "stage %d: layers %d-%d, %d tensors, %d bytes read, %d resident, by placement %s",
        index,
        stage.first_layer,
        stage.last_layer,
        len(keys_read),
        bytes_read,
        resident,
        stats.bytes_per_device,
    )
    return StageModel(model, ctx, stage, dtype, hidden, keys_read, bytes_read, resident, stats, dict(local_map))


def _stage_headers(
    headers: CheckpointHeaders, full: Skeleton, stage: Stage, to_local: dict[str, str]
) -> tuple[CheckpointHeaders, list[str]]:
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
    return sub, sorted(local_of)


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


def _stage_folder(folder: str | os.PathLike | None, index: int) -> Path | None:
    return None if folder is None else Path(folder) / f"stage-{index}"


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def _resident_bytes(model: torch.nn.Module, disk: set[int]) -> int:
    """Bytes of the tensors held in memory (RAM or GPU), each once: not those served from disk."""
    seen: set[int] = set()
    total = 0
    for _, t in _named_tensors(model):
        if t.device.type != "meta" and id(t) not in seen and id(t) not in disk:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _blocks_around_layers(plan: ClusterPlan, prefix: str) -> tuple[list[str], list[str]]:
    """Stage 0's blocks before and after its layers, less those every stage holds (buffer-only, e.g. rotary)."""
    if len(plan.stages) < 2:
        raise CheckpointError("a pipeline needs at least two stages; serve a one-host plan without --pipeline")
    everywhere = set.intersection(*(set(st.plan.placement) for st in plan.stages))
    names = [b for b in plan.stages[0].plan.placement if b not in everywhere]
    first = next(i for i, b in enumerate(names) if b.startswith(prefix + "."))
    return names[:first], [b for b in names[first:] if not b.startswith(prefix + ".")]
