"""Build a :class:`Skeleton` — the model as the planner sees it — without reading a single weight.

Three sources, one result:

* :func:`skeleton_from_config` — a config dict / ``config.json`` / ``PretrainedConfig``: the transformers causal-LM
  class is instantiated on the ``meta`` device (shapes and dtypes, no storage) and walked.
* :func:`skeleton_from_model` — any ``torch.nn.Module`` (meta or real), walked the same way.
* :func:`skeleton_from_dir` — a checkpoint directory: structure from the meta model of its ``config.json``, stored
  dtypes and checkpoint keys from the safetensors headers. Without a usable config, a skeleton inferred from the
  header names alone.

:func:`load_skeleton` dispatches on what the user handed in.

Walking rules (the contract the planner relies on)
--------------------------------------------------
1. Blocks come in ``named_modules()`` order (pre-order, children in registration order), which is execution order
   for transformers' causal LMs: embeddings, decoder layers by index, final norm, (rotary embedding), head.
2. A module whose class name is in the model's ``_no_split_modules`` is ONE block (``no_split=True``) holding every
   parameter and buffer of its subtree, persistent or not; its descendants form no blocks of their own. If it sits
   in an ``nn.ModuleList`` its position there is ``layer_index`` (the KV-cache layer it owns). Within any block,
   tensors are in module pre-order, each module's parameters before its buffers.
3. Any other module that directly owns (``recurse=False``) at least one tensor is a block of just those tensors.
   Modules owning nothing form no block — except the output embedding (rule 5).
4. Tensor names are the full dotted names of the module tree (for Llama/GPT-2 these equal the checkpoint keys).
   ``kind`` is ``parameter``, ``buffer`` (persistent, in the state dict) or ``buffer_nonpersistent`` (e.g. rotary
   ``inv_freq``: not in the checkpoint, but it occupies memory on its device).
5. Tied tensors appear ONCE, in the block of the source (``model.all_tied_weights_keys`` target -> source; Parameter
   objects shared under several names are found through ``named_parameters(remove_duplicate=False)`` too, and the
   first name in registration order is the source). Each group (source first, then aliases) is in
   ``Skeleton.tied_groups``; the planner keeps the blocks of all names of a group on one device. The output head
   block is always emitted, with ``is_head=True``, even when its only tensor is an alias and it therefore holds no
   tensors: the device map must still name it, and the logits buffer lives with it.
6. ``is_head``: the module returned by ``get_output_embeddings()``. ``is_embedding``: ``get_input_embeddings()``
   and every other ``nn.Embedding`` (position embeddings) that forms a block of its own. ``quantizable``: the
   ``weight`` of an ``nn.Linear`` or transformers ``Conv1D`` that is not the head (what bitsandbytes replaces).
7. Dtypes are the meta tensors' dtypes: the model is built in the config's ``dtype`` (as transformers does), buffers
   keep the dtype the architecture gives them. ``default_dtype`` is the config's dtype, else ``float32``.

Everything is one linear pass (iterative, garbage collection paused): no step is quadratic in the number of tensors.

From a checkpoint directory, stored dtypes replace the meta dtypes where a stored key is a module-tree tensor, and
``Skeleton.checkpoint_keys`` is filled (for every block, complete) as soon as any stored key is not a module-tree
name: a key belongs to the block of the module tensor that :mod:`planner.model.checkpoint_keys` (the mapping the loader
reads too) says it holds or helps assemble (fused MoE experts, a ``base_model_prefix`` left out); a stored tied alias
belongs to its source's block; any other key to the block whose name is its longest dotted prefix.
"""

from __future__ import annotations

import copy
import difflib
import gc
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ModelSourceError
from planner.model.checkpoint_keys import tensor_source
from planner.model.config_skeleton import base_model_prefix, config_file_name, config_skeleton
from planner.model.config_values import (
    CONFIG_NAME,
    default_dtype,
    dtype_name,
    kv_geometry,
    model_sizes,
    read_config_json,
)
from planner.model.fingerprint import checkpoint_fingerprint
from planner.model.safetensors_header import CheckpointHeaders, has_weight_files, read_checkpoint_headers
from planner.types import DTYPE_BYTES, Block, Skeleton, TensorSpec

if TYPE_CHECKING:  # torch/transformers are imported lazily: the planner core must stay importable without them
    import torch
    from transformers import PretrainedConfig

    from planner.model.model_ref import HubRef

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------
# configs


def _known_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return list(CONFIG_MAPPING_NAMES)


def _unknown_architecture(what: str, source: str) -> ModelSourceError:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    stem = re.sub(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration|Model)$", "", what).lower()
    near = difflib.get_close_matches(stem, _known_model_types(), n=5, cutoff=0.5)
    if what[:1].isupper():  # a class name: also suggest causal-LM class names
        classes = [c for c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() if isinstance(c, str)]
        near += difflib.get_close_matches(what, classes, n=3, cutoff=0.6)
    hint = f" Nearest known names: {', '.join(near)}." if near else ""
    return ModelSourceError(
        f"{source}: architecture {what!r} is not known to the installed transformers.{hint} "
        "Fix model_type/architectures in the config, or upgrade transformers."
    )


def _model_type_of_architecture(arch: str) -> str | None:
    """The model_type whose causal-LM (or base) class is named ``arch``, e.g. LlamaForCausalLM -> llama."""
    from transformers.models.auto import modeling_auto

    for mapping_name in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"):
        for model_type, cls_name in getattr(modeling_auto, mapping_name, {}).items():
            names = cls_name if isinstance(cls_name, (tuple, list)) else (cls_name,)
            if arch in names:
                return model_type
    return None


def config_from_dict(d: Mapping[str, Any], source: str = "config") -> PretrainedConfig:
    """A transformers config from a plain dict naming ``model_type`` and/or ``architectures``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = dict(d)
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
        d["architectures"] = archs
    if not model_type:
        for arch in archs:
            model_type = _model_type_of_architecture(str(arch))
            if model_type:
                break
        if not model_type:
            if archs:
                raise _unknown_architecture(str(archs[0]), source)
            raise ModelSourceError(
                f"{source}: the config names neither 'model_type' nor 'architectures'; add e.g. "
                '"model_type": "llama" so the architecture is known'
            )
    if model_type not in CONFIG_MAPPING:
        raise _unknown_architecture(str(model_type), source)
    d["model_type"] = model_type
    try:
        return CONFIG_MAPPING[model_type].from_dict(d)
    except Exception as e:  # noqa: BLE001 - transformers' config validators raise many types; all mean "bad config"
        detail = " ".join(str(e).split())
        raise ModelSourceError(f"{source}: not a valid {model_type} config: {detail}") from None


def _as_config(config: Any) -> tuple[PretrainedConfig, str]:
    """(config object, default skeleton name) from a dict, a path or a config object."""
    from transformers import PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config), getattr(config, "_name_or_path", "") or config.model_type
    if isinstance(config, Mapping):
        cfg = config_from_dict(config)
        return cfg, str(config.get("_name_or_path") or cfg.model_type)
    if isinstance(config, (str, os.PathLike)):
        p = Path(config)
        if p.is_dir():
            p = p / CONFIG_NAME
        doc = read_config_json(p)
        cfg = config_from_dict(doc, source=str(p))
        return cfg, config_file_name(p)
    raise ModelSourceError(
        f"cannot build a model skeleton from a {type(config).__name__}; pass a config dict, a config.json path, "
        "a model directory or a transformers PretrainedConfig"
    )


def model_class(cfg: PretrainedConfig) -> type:
    """The transformers class a config describes: the one rule, for the planner and the loader alike.

    The causal-LM class of the config's ``model_type`` (what ``AutoModelForCausalLM`` builds, so a checkpoint whose
    ``architectures`` names a headless base class still gets its LM head), else the first class named in
    ``architectures`` that transformers exports (e.g. an encoder-decoder ``T5ForConditionalGeneration``).
    """
    import transformers
    from transformers import AutoModelForCausalLM

    archs = [str(a) for a in (getattr(cfg, "architectures", None) or [])]
    try:
        mapped = AutoModelForCausalLM._model_mapping[type(cfg)]
    except KeyError:
        mapped = None
    if isinstance(mapped, (list, tuple)):  # several classes for one config: the one the config names, else the first
        mapped = next((c for c in mapped if c.__name__ in archs), mapped[0])
    if mapped is not None:
        return mapped
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and hasattr(cls, "_from_config"):
            return cls
    raise ModelSourceError(
        f"transformers has no causal-LM class for model_type {cfg.model_type!r} "
        f"(architectures={getattr(cfg, 'architectures', None)}). "
        "Name a causal-LM class in 'architectures' (e.g. 'LlamaForCausalLM')."
    )


def build_meta_model(cfg: PretrainedConfig, dtype: str | None = None) -> torch.nn.Module:
    """The model of ``cfg`` on the meta device (no storage, no weight initialisation), in eval mode.

    Built in ``dtype`` (a dtype name; None keeps the config's) exactly as ``from_pretrained`` builds it, so the
    buffers the architecture creates in the default dtype match transformers'. ``cfg.dtype`` is set to it.
    """
    import torch

    cls = model_class(cfg)
    kwargs = {"dtype": getattr(torch, dtype)} if dtype is not None else {}
    with torch.device("meta"):
        try:
            model = cls._from_config(cfg, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the modeling code raises, the config is the cause
            detail = " ".join(str(e).split())
            raise ModelSourceError(
                f"transformers could not build the {cfg.model_type} model from this config: {detail}"
            ) from None
    model.eval()
    return model


# --------------------------------------------------------------------------------------------------------------
# the walk


class _BlockBuilder:
    __slots__ = ("name", "tensors", "no_split", "layer_index", "is_head", "is_embedding")

    def __init__(
        self,
        name: str,
        no_split: bool = False,
        layer_index: int | None = None,
        is_head: bool = False,
        is_embedding: bool = False,
    ):
        self.name = name
        self.tensors: list[TensorSpec] = []
        self.no_split = no_split
        self.layer_index = layer_index
        self.is_head = is_head
        self.is_embedding = is_embedding

    def build(self) -> Block:
        return Block(self.name, tuple(self.tensors), self.no_split, self.layer_index, self.is_head, self.is_embedding)


def _walk(model: torch.nn.Module, no_split: set[str]) -> tuple[list[Block], tuple[tuple[str, ...], ...]]:
    """One pre-order pass over the module tree: blocks (rules 1-6 of the module docstring) and tied groups.

    The traversal is iterative and visits a module once per name it is registered under (like
    ``named_modules(remove_duplicate=False)``), so a tensor reachable under two names is seen under both: the first
    name in registration order keeps it, later names become aliases. Names declared in
    ``model.all_tied_weights_keys`` are aliases of their declared source even when the objects differ.
    """
    import torch.nn as nn

    try:
        from transformers.pytorch_utils import Conv1D

        linear_types: tuple[type, ...] = (nn.Linear, Conv1D)
    except ImportError:  # pragma: no cover - transformers always ships Conv1D
        linear_types = (nn.Linear,)
    try:
        in_emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        in_emb = None
    try:
        out_emb = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        out_emb = None
    declared = {str(t): str(s) for t, s in dict(getattr(model, "all_tied_weights_keys", None) or {}).items() if t != s}

    dtype_names: dict[Any, str] = {}
    first_name: dict[int, str] = {}  # id(tensor) -> the name that owns it
    alias: dict[str, str] = {}  # alias name -> source name
    held_back: list[tuple[_BlockBuilder, TensorSpec]] = []  # declared aliases, in case their source never shows
    builders: list[_BlockBuilder] = []
    module_lists: set[str] = set()
    current: _BlockBuilder | None = None  # the open no-split block, if any
    current_prefix = ""
    stack: list[tuple[str, Any]] = [("", model)]
    while stack:
        mname, mod = stack.pop()
        children = mod._modules
        if children:
            base = mname + "." if mname else ""
            stack.extend(reversed([(base + k, c) for k, c in children.items() if c is not None]))
            if isinstance(mod, nn.ModuleList):
                module_lists.add(mname)
        if current is not None and not mname.startswith(current_prefix):
            current = None
        owner = current
        if owner is None:
            if type(mod).__name__ in no_split:
                parent, _, last = mname.rpartition(".")
                idx = int(last) if last.isdigit() and parent in module_lists else None
                owner = current = _BlockBuilder(mname, no_split=True, layer_index=idx)
                current_prefix = mname + "."
            else:
                owner = _BlockBuilder(
                    mname,
                    is_head=out_emb is not None and mod is out_emb,
                    is_embedding=(in_emb is not None and mod is in_emb) or isinstance(mod, nn.Embedding),
                )
            builders.append(owner)
        params, buffers = mod._parameters, mod._buffers
        if not params and not buffers:
            continue
        prefix = mname + "." if mname else ""
        quantizable_weight = bool(params) and isinstance(mod, linear_types) and mod is not out_emb
        cpu_quantizable_weight = bool(params) and isinstance(mod, nn.Linear) and mod is not out_emb
        for group, is_param in ((params, True), (buffers, False)):
            if not group:
                continue
            nonpersistent = () if is_param else mod._non_persistent_buffers_set
            for tname, t in group.items():
                if t is None:
                    continue
                full = prefix + tname
                src = first_name.setdefault(id(t), full)
                if src != full:
                    alias[full] = src
                    continue
                dtype = dtype_names.get(t.dtype)
                if dtype is None:
                    dtype = dtype_names[t.dtype] = str(t.dtype).replace("torch.", "")
                if is_param:
                    is_weight = tname == "weight" and t.dim() == 2
                    spec = TensorSpec(
                        full,
                        tuple(t.shape),
                        dtype,
                        "parameter",
                        quantizable_weight and tname == "weight",
                        cpu_quantizable_weight and is_weight,
                    )
                else:
                    spec = TensorSpec(
                        full, tuple(t.shape), dtype, "buffer_nonpersistent" if tname in nonpersistent else "buffer"
                    )
                if full in declared:
                    alias[full] = declared[full]
                    held_back.append((owner, spec))
                    del first_name[id(t)]  # let the declared source own this object if it is shared
                    continue
                owner.tensors.append(spec)
    # a declared alias whose source never appeared is a real tensor after all
    owned = set(first_name.values())
    for builder, spec in held_back:
        src, visited = alias[spec.name], {spec.name}
        while src not in owned and src in alias and src not in visited:
            visited.add(src)
            src = alias[src]
        if src in owned:
            alias[spec.name] = src
        else:
            del alias[spec.name]
            builder.tensors.append(spec)
    groups: dict[str, list[str]] = {}
    for a, src in alias.items():
        groups.setdefault(src, [src]).append(a)
    blocks: list[Block] = []
    seen_head = False  # a head module registered under two names is visited twice: keep its first block
    for b in builders:
        if b.tensors or (b.is_head and not seen_head):
            blocks.append(b.build())
            seen_head = seen_head or b.is_head
    return blocks, tuple(tuple(g) for g in groups.values())


def skeleton_from_model(model: torch.nn.Module, *, name: str | None = None) -> Skeleton:
    """Walk a (meta or real) model into a Skeleton; see the module docstring for the rules."""
    cfg = getattr(model, "config", None)
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the walk allocates ~1 object per tensor; collecting over a large module graph is the slow part
    try:
        blocks, groups = _walk(model, no_split)
    finally:
        if gc_was_enabled:
            gc.enable()
    n_layers = sum(1 for b in blocks if b.layer_index is not None)
    kv = kv_geometry(cfg, n_layers or None) if cfg is not None else None
    sizes = model_sizes(cfg) if cfg is not None else {}
    model_type = str(getattr(cfg, "model_type", "") or "")
    default = default_dtype(getattr(cfg, "dtype", None)) if cfg is not None else None
    if name is None:
        name = str(getattr(cfg, "_name_or_path", "") or model_type or type(model).__name__)
    for d in {t.dtype for b in blocks for t in b.tensors}:
        if d not in DTYPE_BYTES:
            raise ModelSourceError(f"{name}: tensor dtype {d!r} is not one the planner can size")
    return Skeleton(
        name=name,
        architecture=type(model).__name__,
        model_type=model_type,
        blocks=tuple(blocks),
        tied_groups=groups,
        no_split_classes=tuple(sorted(no_split)),
        kv=kv,
        default_dtype=default or "float32",
        **sizes,
    )


def skeleton_from_config(
    config: dict | PretrainedConfig | str | Path, *, name: str | None = None, meta_walk: bool = False
) -> Skeleton:
    """Skeleton of the causal LM a config describes.

    A dict or config file of a family :mod:`planner.model.config_skeleton` knows is laid out from the config alone (no
    torch, no transformers: milliseconds). Everything else, and everything with ``meta_walk=True``, is built on the
    meta device and walked (no memory, < 1 s for 70B once torch is imported).
    """
    if not meta_walk and isinstance(config, (Mapping, str, os.PathLike)):
        doc, default_name = config, None
        if not isinstance(config, Mapping):
            p = Path(config)
            p = p / CONFIG_NAME if p.is_dir() else p
            doc, default_name = read_config_json(p), config_file_name(p)
        fast = config_skeleton(doc, name=name or default_name)
        if fast is not None:
            return fast
    cfg, default_name = _as_config(config)
    model = build_meta_model(cfg)
    return skeleton_from_model(model, name=name or default_name)


# --------------------------------------------------------------------------------------------------------------
# checkpoint directories


def _block_of_key(
    key: str, tensor_block: Mapping[str, str], block_names: set[str], base_prefix: str
) -> tuple[str | None, str | None]:
    """(block, tensor name) a checkpoint key belongs to. The tensor name is set when the key IS a tensor of the
    module tree (directly, or with the model's ``base_model_prefix`` prepended: old GPT-2 checkpoints store
    ``h.0...``). Otherwise the block is the longest block name that is a dotted prefix of the key (a stored
    tensor the model does not use, such as an old GPT-2 ``attn.bias`` mask) and the tensor name is None."""
    candidates = (key, f"{base_prefix}.{key}") if base_prefix else (key,)
    for k in candidates:
        b = tensor_block.get(k)
        if b is not None:
            return b, k
    for k in candidates:
        pos = len(k)
        while pos > 0:
            pos = k.rfind(".", 0, pos)
            if pos <= 0:
                break
            if k[:pos] in block_names:
                return k[:pos], None
    return None, None


def _with_checkpoint(skel: Skeleton, headers: CheckpointHeaders, base_prefix: str, name: str) -> Skeleton:
    """Apply stored dtypes and checkpoint-key ownership from the headers to a config-built skeleton."""
    stored = headers.tensors
    tensor_block = skel.block_of_tensor()
    alias_source = {a: g[0] for g in skel.tied_groups for a in g[1:]}
    block_names = {b.name for b in skel.blocks}
    keys_of: dict[str, list[str]] = {}
    key_of_tensor: dict[str, str] = {}  # module-tree name -> the stored key holding exactly that tensor
    fused_dtype: dict[str, str] = {}  # module-tree name -> stored dtype of the pieces it is assembled from
    claimed: set[str] = set()
    # Every module tensor's keys, through the one mapping the loader also reads (planner.model.checkpoint_keys).
    for blk in skel.blocks:
        for t in blk.tensors:
            if t.kind == "buffer_nonpersistent":
                continue
            src = tensor_source(t.name, t.shape, stored, base_prefix)
            if src is None:
                continue
            for piece in src.pieces:
                if piece.key not in claimed:
                    claimed.add(piece.key)
                    keys_of.setdefault(blk.name, []).append(piece.key)
            if src.is_plain:
                key_of_tensor[t.name] = src.pieces[0].key
            else:
                fused_dtype[t.name] = stored[src.pieces[0].key].dtype
    # The rest: a stored tied alias belongs to its source's block, anything else to its longest block prefix.
    unmatched: list[str] = []
    for key in stored:
        if key in claimed:
            continue
        b, _ = _block_of_key(alias_source.get(key, key), tensor_block, block_names, base_prefix)
        if b is None:
            unmatched.append(key)
            continue
        keys_of.setdefault(b, []).append(key)
    renamed = any(k not in tensor_block for ks in keys_of.values() for k in ks)
    if unmatched:
        log.warning(
            "%s: %d checkpoint tensor(s) match no module of the %s model and will not be placed: %s",
            name,
            len(unmatched),
            skel.architecture,
            ", ".join(unmatched[:5]),
        )

    blocks = []
    shape_mismatch = []
    for blk in skel.blocks:
        new_tensors = []
        for t in blk.tensors:
            k = key_of_tensor.get(t.name)
            h = stored[k] if k is not None else None
            if h is not None:
                if h.shape != t.shape:
                    shape_mismatch.append(f"{t.name}: model {list(t.shape)}, checkpoint {list(h.shape)}")
                if h.dtype != t.dtype:
                    t = t._replace(dtype=h.dtype)
            elif t.name in fused_dtype and fused_dtype[t.name] != t.dtype:
                t = t._replace(dtype=fused_dtype[t.name])
            new_tensors.append(t)
        blocks.append(Block(blk.name, tuple(new_tensors), blk.no_split, blk.layer_index, blk.is_head, blk.is_embedding))
    if shape_mismatch:
        log.warning(
            "%s: %d tensor(s) differ in shape between config.json and the checkpoint (first: %s); "
            "the skeleton follows the config",
            name,
            len(shape_mismatch),
            shape_mismatch[0],
        )

    # cross-check: bytes stored vs bytes the model needs for what the checkpoint holds (tied tensors once)
    stored_bytes = sum(stored[k].nbytes for ks in keys_of.values() for k in ks if k not in alias_source)
    in_ckpt = set(key_of_tensor)
    need = 0
    for blk in blocks:
        for t in blk.tensors:
            if t.kind == "parameter" or (t.kind == "buffer" and t.name in in_ckpt):
                need += int(t.numel * DTYPE_BYTES[t.dtype])
    if stored_bytes < need:
        log.warning(
            "%s: the checkpoint stores %d bytes of the model's tensors but the %s built from config.json "
            "needs %d; config and weights may not belong together",
            name,
            stored_bytes,
            skel.architecture,
            need,
        )
    elif stored_bytes > need:  # e.g. legacy buffers (old GPT-2 attn.bias masks) that transformers now ignores
        log.info("%s: the checkpoint stores %d bytes more than the model uses", name, stored_bytes - need)

    # Complete or empty: when any stored key is not a module-tree name (fused experts, a stored tied alias, a
    # base-model prefix), every block that stores something lists all its keys, so a loader needs no other source.
    ckpt_keys = {b: tuple(ks) for b, ks in keys_of.items()} if renamed else {}
    return Skeleton(
        name=name,
        architecture=skel.architecture,
        model_type=skel.model_type,
        blocks=tuple(blocks),
        tied_groups=skel.tied_groups,
        no_split_classes=skel.no_split_classes,
        kv=skel.kv,
        vocab_size=skel.vocab_size,
        hidden_size=skel.hidden_size,
        intermediate_size=skel.intermediate_size,
        num_attention_heads=skel.num_attention_heads,
        experts_per_token=skel.experts_per_token,
        default_dtype=skel.default_dtype,
        checkpoint_keys=ckpt_keys,
    )


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block|decoder_layers)\.(\d+)(?=\.)")
_EMBED_HINTS = ("embed", "wte", "wpe", "tok_embeddings", "word_embeddings", "position_embeddings")
_HEAD_HINTS = ("lm_head", "embed_out", "output", "head")


def skeleton_from_headers(
    headers: CheckpointHeaders, *, name: str, config: Mapping[str, Any] | None = None
) -> Skeleton:
    """A skeleton inferred from checkpoint key names alone (no transformers class needed).

    Keys under ``<prefix>.layers.N.`` (also ``h.N``, ``blocks.N``, ``layer.N``) form no-split blocks with
    ``layer_index = N``; every other key joins the block of its parent module. Order: embeddings, layers by
    index, other blocks (norms) by name, head. Every tensor is a ``parameter`` with its stored dtype and name.
    """
    layer_blocks: dict[str, tuple[int, list[TensorSpec]]] = {}
    other: dict[str, list[TensorSpec]] = {}
    for key, h in headers.tensors.items():
        m = _LAYER_RE.search(key)
        is_weight = key.endswith(".weight") and len(h.shape) == 2
        if m:
            bname = key[: m.end()]
            idx = int(m.group(1))
            layer_blocks.setdefault(bname, (idx, []))[1].append(
                TensorSpec(key, h.shape, h.dtype, "parameter", is_weight, is_weight)
            )
        else:
            parent = key.rpartition(".")[0]
            other.setdefault(parent, []).append(TensorSpec(key, h.shape, h.dtype, "parameter", False))

    def leaf(n: str) -> str:
        return n.rpartition(".")[2].lower()

    def category(n: str) -> int:
        last = leaf(n)
        if any(x in last for x in _EMBED_HINTS):
            return 0
        if last in _HEAD_HINTS or last.endswith("head"):
            return 3
        return 2

    blocks: list[Block] = []
    for bname in sorted(n for n in other if category(n) == 0):
        blocks.append(Block(bname, tuple(other[bname]), is_embedding=True))
    for bname, (idx, ts) in sorted(layer_blocks.items(), key=lambda kv: (kv[1][0], kv[0])):
        blocks.append(Block(bname, tuple(ts), no_split=True, layer_index=idx))
    for bname in sorted(n for n in other if category(n) == 2):
        blocks.append(Block(bname, tuple(other[bname])))
    for bname in sorted(n for n in other if category(n) == 3):
        blocks.append(Block(bname, tuple(other[bname]), is_head=True))
    default = default_dtype(_config_dtype(config or {}), (t.dtype for t in headers.tensors.values()))
    n_layers = len({idx for idx, _ in layer_blocks.values()})
    kv = kv_geometry(config, n_layers or None) if config else None
    sizes = model_sizes(config) if config else {}
    return Skeleton(
        name=name,
        architecture=str(((config or {}).get("architectures") or ["unknown"])[0]),
        model_type=str((config or {}).get("model_type") or "unknown"),
        blocks=tuple(blocks),
        kv=kv,
        default_dtype=default,
        **sizes,
    )


def _config_dtype(doc: Mapping[str, Any]) -> Any:
    return doc.get("dtype") or doc.get("torch_dtype")


def _checkpoint_headers(d: Path) -> CheckpointHeaders:
    """The headers of a model directory's shards, or the error that says what the directory lacks."""
    if not d.is_dir():
        raise ModelSourceError(f"{d}: not a directory")
    has_config = (d / CONFIG_NAME).is_file()
    if not has_config and not has_weight_files(d):
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        extra = (
            (
                f" Found pickle weight files ({', '.join(pickles[:3])}), which loadmaster refuses to read; "
                "convert them to safetensors."
            )
            if pickles
            else ""
        )
        raise ModelSourceError(
            f"{d}: not a model directory: expected {CONFIG_NAME} and safetensors weights "
            f"(model.safetensors, or model.safetensors.index.json with its shards), found neither.{extra}"
        )
    if not has_weight_files(d):
        # read_checkpoint_headers raises the precise error (and mentions refused pickle files)
        try:
            read_checkpoint_headers(d)
        except ModelSourceError as e:
            raise ModelSourceError(
                f"{e}. To plan from the architecture alone, pass {d / CONFIG_NAME} instead of the directory."
            ) from None
    return read_checkpoint_headers(d)


#: Dtypes a model can be built in (torch's default dtype must be one of them).
_BUILD_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CheckpointModel:
    """A checkpoint directory's model, described once, for the planner and the loader alike.

    ``skeleton`` is what the planner plans with (plain data, with the checkpoint's fingerprint); ``model`` is the
    transformers model it was walked from, on the meta device, built in ``dtype``: what the loader fills with
    the checkpoint's tensors. ``headers`` are the shards' validated safetensors headers.
    """

    skeleton: Skeleton
    model: Any  # torch.nn.Module on the meta device
    headers: CheckpointHeaders
    dtype: str


def describe_checkpoint(
    path: str | os.PathLike,
    dtype: str | None = None,
    *,
    name: str | None = None,
    headers: CheckpointHeaders | None = None,
) -> CheckpointModel:
    """Read a model directory (``config.json`` + safetensors headers; no weight is read) into its Skeleton and its
    meta model, built in ``dtype`` (a dtype name; None: the model's :func:`default_dtype`). ``headers``: the
    directory's headers when the caller has already read them.

    Raises :class:`ModelSourceError` when the directory has no usable config or transformers cannot build it.
    """
    d = Path(path)
    headers = headers if headers is not None else _checkpoint_headers(d)
    name = name or d.resolve().name
    if not (d / CONFIG_NAME).is_file():
        raise ModelSourceError(f"{d} has no {CONFIG_NAME}: point at a model directory saved by save_pretrained.")
    return _describe(read_config_json(d / CONFIG_NAME), headers, dtype, name=name, source=str(d))


def describe_config(
    doc: Mapping[str, Any], headers: CheckpointHeaders, dtype: str | None, *, name: str, source: str
) -> CheckpointModel:
    """:func:`describe_checkpoint` from a config document and headers the caller holds: a pipeline stage describes
    its own sub-model (fewer layers) with the headers of its own tensors, renamed to the sub-model's names."""
    return _describe(doc, headers, dtype, name=name, source=source)


def _describe(
    doc: Mapping[str, Any], headers: CheckpointHeaders, dtype: str | None, *, name: str, source: str
) -> CheckpointModel:
    """:func:`describe_checkpoint` from a config document and headers, wherever they were read (a directory, the
    Hub)."""
    cfg = config_from_dict(doc, source=f"{source}/{CONFIG_NAME}")
    default = default_dtype(_config_dtype(doc), (t.dtype for t in headers.tensors.values()))
    build = dtype or default
    model = build_meta_model(cfg, build if build in _BUILD_DTYPES else None)
    skel = _with_checkpoint(
        skeleton_from_model(model, name=name), headers, str(getattr(model, "base_model_prefix", "") or ""), name
    )
    skel = replace(skel, default_dtype=default, fingerprint=checkpoint_fingerprint(headers))
    return CheckpointModel(skel, model, headers, dtype_name(getattr(model.config, "dtype", None)) or build)


def skeleton_from_dir(path: str | os.PathLike, *, name: str | None = None, meta_walk: bool = False) -> Skeleton:
    """Skeleton of a checkpoint directory: ``config.json`` for structure, safetensors headers for stored dtypes,
    and the checkpoint's fingerprint.

    A family :mod:`planner.model.config_skeleton` knows is laid out from the config alone (unless ``meta_walk``); others
    are walked from their meta model (:func:`describe_checkpoint`). Without a ``config.json``, or when transformers
    does not know its architecture, the skeleton is inferred from the header names (see
    :func:`skeleton_from_headers`) and a warning says so.
    """
    d = Path(path)
    headers = _checkpoint_headers(d)
    name = name or d.resolve().name
    doc = read_config_json(d / CONFIG_NAME) if (d / CONFIG_NAME).is_file() else None
    return skeleton_from_checkpoint(doc, headers, name=name, source=str(d), meta_walk=meta_walk)


def skeleton_from_checkpoint(
    doc: Mapping[str, Any] | None, headers: CheckpointHeaders, *, name: str, source: str, meta_walk: bool = False
) -> Skeleton:
    """Skeleton from a config.json document (or none) and the checkpoint's headers, wherever both were read (a
    local directory, or the Hub: see :mod:`planner.model.model_ref`); see :func:`skeleton_from_dir`."""
    fingerprint = checkpoint_fingerprint(headers)
    if doc is None:
        log.warning(
            "%s: no %s; the skeleton is inferred from safetensors key names (no tied groups, buffers or "
            "KV geometry known)",
            source,
            CONFIG_NAME,
        )
        return replace(skeleton_from_headers(headers, name=name), fingerprint=fingerprint)
    fast = None if meta_walk else config_skeleton(dict(doc), name=name)
    if fast is not None:
        skel = _with_checkpoint(fast, headers, base_model_prefix(fast.model_type) or "", name)
        default = default_dtype(_config_dtype(doc), (t.dtype for t in headers.tensors.values()))
        return replace(skel, default_dtype=default, fingerprint=fingerprint)
    try:
        return _describe(doc, headers, None, name=name, source=source).skeleton
    except ModelSourceError as e:
        log.warning("%s; the skeleton is inferred from safetensors key names instead", e)
        return replace(skeleton_from_headers(headers, name=name, config=doc), fingerprint=fingerprint)


def skeleton_from_hub(ref: HubRef, *, name: str | None = None) -> Skeleton:
    """Skeleton of a Hub model from its config.json and shard headers only (see :mod:`planner.model.model_ref`); it
    names the commit it was read at. Offline, a cached snapshot is read like a local directory."""
    from planner.model.model_ref import read_hub_checkpoint

    hub = read_hub_checkpoint(ref)
    name = name or ref.repo_id
    if hub.snapshot is not None:
        skel = skeleton_from_dir(hub.snapshot, name=name)
    else:
        assert hub.headers is not None
        skel = skeleton_from_checkpoint(hub.config, hub.headers, name=name, source=hub.source)
    return replace(skel, revision=hub.commit)


def load_skeleton(model: Any, *, name: str | None = None) -> Skeleton:
    """The Skeleton of whatever the user names: a Skeleton, a config dict or object, a model directory, a
    ``config.json`` path, a Hub id ``org/name[@revision]`` (config and shard headers only), or a torch module."""
    if isinstance(model, Skeleton):
        return model
    if isinstance(model, Mapping):
        return skeleton_from_config(model, name=name)
    if isinstance(model, (str, os.PathLike)):
        from planner.model.model_ref import HubRef, cached_snapshot_of, parse_model_ref

        ref = parse_model_ref(model)
        if isinstance(ref, HubRef):
            return skeleton_from_hub(ref, name=name)
        p = Path(model).expanduser()
        if ref is None:
            raise ModelSourceError(
                f"{p}: no such file or directory; pass a model directory (config.json + safetensors), "
                "a config.json file, or a Hub id org/name[@revision]"
            )
        if p.is_dir():
            snapshot = cached_snapshot_of(p)  # a Hub cache folder: name the repository and its commit
            if snapshot is None:
                return skeleton_from_dir(p, name=name)
            return replace(skeleton_from_dir(p, name=name or snapshot.repo_id), revision=snapshot.revision)
        if p.suffix == ".json":
            return skeleton_from_config(p, name=name)
        raise ModelSourceError(
            f"{p}: expected a model directory or a .json config file, got a {p.suffix or 'plain'} file"
        )
    try:
        import torch.nn as nn

        if isinstance(model, nn.Module):
            return skeleton_from_model(model, name=name)
    except ImportError:  # pragma: no cover
        pass
    return skeleton_from_config(model, name=name)
