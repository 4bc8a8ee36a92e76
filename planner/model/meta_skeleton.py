"""The meta-device route to a :class:`Skeleton`: a config becomes the transformers model it describes, built on the
``meta`` device (shapes and dtypes, no storage), and that module tree is walked into blocks.

:func:`config_from_dict` and :func:`model_class` are the one rule by which a config names a transformers class, for
the planner and the loader alike; :func:`build_meta_model` builds it; :func:`skeleton_from_model` walks any module
(meta or real). Families :mod:`planner.model.config_skeleton` knows skip all this (see
:func:`planner.model.skeleton.skeleton_from_config`), and give the same Skeleton.

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
"""

from __future__ import annotations

import copy
import difflib
import gc
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ModelSourceError
from planner.model.config_skeleton import config_file_name
from planner.model.config_values import CONFIG_NAME, default_dtype, kv_geometry, model_sizes, read_config_json
from planner.types import DTYPE_BYTES, Block, Skeleton, TensorSpec

if TYPE_CHECKING:  # torch/transformers are imported lazily: the planner core must stay importable without them
    import torch
    from transformers import PretrainedConfig

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


def as_config(config: Any) -> tuple[PretrainedConfig, str]:
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


@dataclass(frozen=True)
class _ModelRoles:
    """What the walk recognises in this model, read off it once before the pass: the classes whose ``weight`` is
    quantizable (rule 6: bitsandbytes' ``nn.Linear`` and ``Conv1D``; the native CPU formats take ``nn.Linear`` only),
    the input and output embedding modules (rules 5-6) and the tied names the model declares (rule 5)."""

    linear_types: tuple[type, ...]
    cpu_linear_type: type
    embedding_type: type
    module_list_type: type
    input_embeddings: Any
    output_embeddings: Any
    declared_ties: dict[str, str]  # alias name -> source name (``all_tied_weights_keys``)


def _model_roles(model: torch.nn.Module) -> _ModelRoles:
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
    return _ModelRoles(linear_types, nn.Linear, nn.Embedding, nn.ModuleList, in_emb, out_emb, declared)


class _Walk:
    """The state of one pass over the module tree: the blocks opened so far, the name that owns each tensor object,
    and the aliases found. Each step of the pass (open a block, take a module's own tensors, settle the declared
    ties at the end) is a method, so :func:`_walk` itself stays the one loop over the modules."""

    def __init__(self, roles: _ModelRoles, no_split: set[str]):
        self.roles = roles
        self.no_split = no_split
        self.builders: list[_BlockBuilder] = []
        self.module_lists: set[str] = set()  # names of the nn.ModuleLists seen (their children are layers)
        self.first_name: dict[int, str] = {}  # id(tensor) -> the name that owns it
        self.alias: dict[str, str] = {}  # alias name -> source name
        #: Declared aliases, held back in case their source never shows.
        self.held_back: list[tuple[_BlockBuilder, TensorSpec]] = []
        self._dtype_names: dict[Any, str] = {}
        self._open: _BlockBuilder | None = None  # the open no-split block, if any
        self._open_prefix = ""

    def block_for(self, mname: str, mod: Any) -> _BlockBuilder:
        """The block ``mod``'s own tensors join: the open no-split block while the pass is inside its subtree (rule
        2), else a new block, no-split if its class says so (rules 2-3, 6)."""
        if self._open is not None and not mname.startswith(self._open_prefix):
            self._open = None
        if self._open is not None:
            return self._open
        roles = self.roles
        if type(mod).__name__ in self.no_split:
            parent, _, last = mname.rpartition(".")
            idx = int(last) if last.isdigit() and parent in self.module_lists else None
            owner = self._open = _BlockBuilder(mname, no_split=True, layer_index=idx)
            self._open_prefix = mname + "."
        else:
            in_emb, out_emb = roles.input_embeddings, roles.output_embeddings
            owner = _BlockBuilder(
                mname,
                is_head=out_emb is not None and mod is out_emb,
                is_embedding=(in_emb is not None and mod is in_emb) or isinstance(mod, roles.embedding_type),
            )
        self.builders.append(owner)
        return owner

    def take_tensors(self, mname: str, mod: Any, owner: _BlockBuilder) -> None:
        """``mod``'s own parameters, then its buffers, into ``owner`` (rules 2-6): a tensor object already seen
        under another name becomes an alias of that name, a declared alias is held back until the pass is over."""
        roles = self.roles
        params = mod._parameters
        prefix = mname + "." if mname else ""
        not_head = mod is not roles.output_embeddings
        quantizable_weight = bool(params) and isinstance(mod, roles.linear_types) and not_head
        cpu_quantizable_weight = bool(params) and isinstance(mod, roles.cpu_linear_type) and not_head
        packed = getattr(mod, "loadmaster_packed", False)  # a pre-quantized layer's stored tensors
        for group, is_param in ((params, True), (mod._buffers, False)):
            if not group:
                continue
            nonpersistent = () if is_param else mod._non_persistent_buffers_set
            for tname, t in group.items():
                if t is None:
                    continue
                full = prefix + tname
                src = self.first_name.setdefault(id(t), full)
                if src != full:
                    self.alias[full] = src
                    continue
                dtype = self._dtype_name(t.dtype)
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
                    kind = "buffer_nonpersistent" if tname in nonpersistent else "buffer"
                    spec = TensorSpec(full, tuple(t.shape), dtype, "packed" if packed else kind)
                if full in roles.declared_ties:
                    self.alias[full] = roles.declared_ties[full]
                    self.held_back.append((owner, spec))
                    del self.first_name[id(t)]  # let the declared source own this object if it is shared
                    continue
                owner.tensors.append(spec)

    def _dtype_name(self, dtype: Any) -> str:
        name = self._dtype_names.get(dtype)
        if name is None:
            name = self._dtype_names[dtype] = str(dtype).replace("torch.", "")
        return name

    def settle_declared_ties(self) -> None:
        """A declared alias whose source (followed through other aliases) never appeared is a real tensor after
        all: it joins the block it was found in. The others point at the source that owns the object."""
        owned = set(self.first_name.values())
        for builder, spec in self.held_back:
            src, visited = self.alias[spec.name], {spec.name}
            while src not in owned and src in self.alias and src not in visited:
                visited.add(src)
                src = self.alias[src]
            if src in owned:
                self.alias[spec.name] = src
            else:
                del self.alias[spec.name]
                builder.tensors.append(spec)

    def blocks(self) -> list[Block]:
        """The blocks that hold tensors, and the head's first block even when it holds none (rule 5)."""
        blocks: list[Block] = []
        seen_head = False  # a head module registered under two names is visited twice: keep its first block
        for b in self.builders:
            if b.tensors or (b.is_head and not seen_head):
                blocks.append(b.build())
                seen_head = seen_head or b.is_head
        return blocks

    def tied_groups(self) -> tuple[tuple[str, ...], ...]:
        """Each source with its aliases (source first), in the order the aliases were found."""
        groups: dict[str, list[str]] = {}
        for a, src in self.alias.items():
            groups.setdefault(src, [src]).append(a)
        return tuple(tuple(g) for g in groups.values())


def _walk(model: torch.nn.Module, no_split: set[str]) -> tuple[list[Block], tuple[tuple[str, ...], ...]]:
    """One pre-order pass over the module tree: blocks (rules 1-6 of the module docstring) and tied groups.

    The traversal is iterative and visits a module once per name it is registered under (like
    ``named_modules(remove_duplicate=False)``), so a tensor reachable under two names is seen under both: the first
    name in registration order keeps it, later names become aliases. Names declared in
    ``model.all_tied_weights_keys`` are aliases of their declared source even when the objects differ.
    """
    walk = _Walk(_model_roles(model), no_split)
    module_list_type = walk.roles.module_list_type
    stack: list[tuple[str, Any]] = [("", model)]
    while stack:
        mname, mod = stack.pop()
        children = mod._modules
        if children:
            base = mname + "." if mname else ""
            stack.extend(reversed([(base + k, c) for k, c in children.items() if c is not None]))
            if isinstance(mod, module_list_type):
                walk.module_lists.add(mname)
        owner = walk.block_for(mname, mod)
        if mod._parameters or mod._buffers:
            walk.take_tensors(mname, mod, owner)
    walk.settle_declared_ties()
    return walk.blocks(), walk.tied_groups()


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
