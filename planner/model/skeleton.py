"""Build a :class:`Skeleton` — the model as the planner sees it — without reading a single weight.

Three sources, one result:

* :func:`skeleton_from_config` — a config dict / ``config.json`` / ``PretrainedConfig``: laid out from the config
  alone for families :mod:`planner.model.config_skeleton` knows, else the transformers causal-LM class is
  instantiated on the ``meta`` device (shapes and dtypes, no storage) and walked (:mod:`planner.model.meta_skeleton`,
  which states the walking rules the planner relies on).
* :func:`skeleton_from_model` — any ``torch.nn.Module`` (meta or real), walked the same way.
* :func:`skeleton_from_dir` — a checkpoint directory: structure from its ``config.json``, stored dtypes and
  checkpoint keys from the safetensors headers (:mod:`planner.model.checkpoint_reconcile`). Without a usable
  config, a skeleton inferred from the header names alone.

:func:`load_skeleton` dispatches on what the user handed in.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ModelSourceError
from planner.model.checkpoint_reconcile import reconcile
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
from planner.model.meta_skeleton import as_config, build_meta_model, config_from_dict, skeleton_from_model
from planner.model.quant_config import quant_format
from planner.model.safetensors_header import CheckpointHeaders, has_weight_files, read_checkpoint_headers
from planner.types import Block, Skeleton, StoredFormat, TensorSpec

if TYPE_CHECKING:  # torch/transformers are imported lazily: the planner core must stay importable without them
    from transformers import PretrainedConfig

    from planner.model.model_ref import HubRef

log = logging.getLogger(__name__)


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
    cfg, default_name = as_config(config)
    model = build_meta_model(cfg)
    return skeleton_from_model(model, name=name or default_name)


# --------------------------------------------------------------------------------------------------------------
# checkpoint directories


def _with_checkpoint(skel: Skeleton, headers: CheckpointHeaders, base_prefix: str, name: str) -> Skeleton:
    """Apply stored dtypes and checkpoint-key ownership from the headers to a config-built skeleton, and say what
    the two disagree on (under this module's logger, which a pipeline stage quiets past stage 0)."""
    r = reconcile(skel, headers, base_prefix, name)
    if r.unmatched:
        log.warning(
            "%s: %d checkpoint tensor(s) match no module of the %s model and will not be placed: %s",
            name,
            len(r.unmatched),
            skel.architecture,
            ", ".join(r.unmatched[:5]),
        )
    if r.shape_mismatches:
        log.warning(
            "%s: %d tensor(s) differ in shape between config.json and the checkpoint (first: %s); "
            "the skeleton follows the config",
            name,
            len(r.shape_mismatches),
            r.shape_mismatches[0],
        )
    if r.stored_bytes < r.needed_bytes:
        log.warning(
            "%s: the checkpoint stores %d bytes of the model's tensors but the %s built from config.json "
            "needs %d; config and weights may not belong together",
            name,
            r.stored_bytes,
            skel.architecture,
            r.needed_bytes,
        )
    elif r.stored_bytes > r.needed_bytes:  # e.g. legacy buffers (old GPT-2 attn.bias masks) that transformers ignores
        log.info("%s: the checkpoint stores %d bytes more than the model uses", name, r.stored_bytes - r.needed_bytes)
    return r.skeleton


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
    fmt = quant_format(doc)
    if fmt is not None:  # built unquantized; the packed layers are swapped in below, as stored
        doc = {k: v for k, v in doc.items() if k != "quantization_config"}
    cfg = config_from_dict(doc, source=f"{source}/{CONFIG_NAME}")
    default = default_dtype(_config_dtype(doc), (t.dtype for t in headers.tensors.values()))
    build = dtype or default
    model = build_meta_model(cfg, build if build in _BUILD_DTYPES else None)
    if fmt is not None:
        from planner.model.packed_experts import swap_packed_experts
        from planner.model.packed_linear import swap_packed_linears

        experts = swap_packed_experts(model, fmt, headers.tensors)
        n = swap_packed_linears(model, fmt, headers.tensors)
        model.loadmaster_quant_format = fmt
        log.info("%s: %d linear layers and %d experts modules stored as %s", name, n, experts, fmt.describe)
    skel = _with_checkpoint(
        skeleton_from_model(model, name=name), headers, str(getattr(model, "base_model_prefix", "") or ""), name
    )
    stored = StoredFormat(fmt.describe, fmt.cpu_kernel) if fmt is not None else None
    skel = replace(skel, default_dtype=default, fingerprint=checkpoint_fingerprint(headers), stored_format=stored)
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
