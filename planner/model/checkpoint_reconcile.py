"""A skeleton built from a config, reconciled with the checkpoint's safetensors headers (no weight is read).

Stored dtypes replace the built dtypes where a stored key is a module-tree tensor, and ``Skeleton.checkpoint_keys``
is filled (for every block, complete) as soon as any stored key is not a module-tree name: a key belongs to the
block of the module tensor that :mod:`planner.model.checkpoint_keys` (the mapping the loader reads too) says it
holds or helps assemble (fused MoE experts, a ``base_model_prefix`` left out); a stored tied alias belongs to its
source's block; any other key to the block whose name is its longest dotted prefix.

What the checkpoint and the config disagree on (keys no module takes, shapes that differ, fewer bytes stored than
the model needs) is returned, not logged: :mod:`planner.model.skeleton` says it under its own logger.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.model.checkpoint_keys import tensor_source
from planner.model.safetensors_header import CheckpointHeaders, HeaderTensor
from planner.types import DTYPE_BYTES, Block, Skeleton


@dataclass(frozen=True)
class Reconciled:
    """The skeleton with the checkpoint's dtypes and keys, and what the two disagree on.

    ``unmatched``: stored keys no block takes (they will not be placed). ``shape_mismatches``: one line per module
    tensor whose stored shape differs from the config's (the skeleton follows the config). ``stored_bytes`` and
    ``needed_bytes``: what the checkpoint stores of the model's tensors (tied ones once) against what the model
    needs of what the checkpoint holds; fewer stored means config and weights may not belong together.
    """

    skeleton: Skeleton
    unmatched: list[str]
    shape_mismatches: list[str]
    stored_bytes: int
    needed_bytes: int


@dataclass
class _KeyOwnership:
    """Which block each stored key belongs to, filled in two passes (module tensors first, then the rest), in the
    order the keys are claimed: that order is the order of ``Skeleton.checkpoint_keys``."""

    keys_of: dict[str, list[str]] = field(default_factory=dict)  # block -> its stored keys
    key_of_tensor: dict[str, str] = field(default_factory=dict)  # module-tree name -> the key holding exactly it
    fused_dtype: dict[str, str] = field(
        default_factory=dict
    )  # module-tree name -> dtype of the pieces it is built from
    claimed: set[str] = field(default_factory=set)
    unmatched: list[str] = field(default_factory=list)


def reconcile(skel: Skeleton, headers: CheckpointHeaders, base_prefix: str, name: str) -> Reconciled:
    """Apply stored dtypes and checkpoint-key ownership from the headers to a config-built skeleton."""
    stored = headers.tensors
    alias_source = {a: g[0] for g in skel.tied_groups for a in g[1:]}
    tensor_block = skel.block_of_tensor()
    owners = _KeyOwnership()
    _claim_module_tensor_keys(skel, stored, base_prefix, owners)
    _claim_other_keys(skel, stored, base_prefix, tensor_block, alias_source, owners)
    renamed = any(k not in tensor_block for ks in owners.keys_of.values() for k in ks)
    blocks, shape_mismatches = _with_stored_dtypes(skel.blocks, stored, owners)
    stored_bytes = sum(stored[k].nbytes for ks in owners.keys_of.values() for k in ks if k not in alias_source)
    # Complete or empty: when any stored key is not a module-tree name (fused experts, a stored tied alias, a
    # base-model prefix), every block that stores something lists all its keys, so a loader needs no other source.
    ckpt_keys = {b: tuple(ks) for b, ks in owners.keys_of.items()} if renamed else {}
    reconciled = Skeleton(
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
    needed = _needed_bytes(blocks, set(owners.key_of_tensor))
    return Reconciled(reconciled, owners.unmatched, shape_mismatches, stored_bytes, needed)


def _claim_module_tensor_keys(
    skel: Skeleton, stored: Mapping[str, HeaderTensor], base_prefix: str, owners: _KeyOwnership
) -> None:
    """Every module tensor's keys, through the one mapping the loader also reads (planner.model.checkpoint_keys):
    a plain key names the tensor it holds, the pieces of a fused tensor give it their stored dtype."""
    for blk in skel.blocks:
        for t in blk.tensors:
            if t.kind == "buffer_nonpersistent":
                continue
            src = tensor_source(t.name, t.shape, stored, base_prefix)
            if src is None:
                continue
            for piece in src.pieces:
                if piece.key not in owners.claimed:
                    owners.claimed.add(piece.key)
                    owners.keys_of.setdefault(blk.name, []).append(piece.key)
            if src.is_plain:
                owners.key_of_tensor[t.name] = src.pieces[0].key
            else:
                owners.fused_dtype[t.name] = stored[src.pieces[0].key].dtype


def _claim_other_keys(
    skel: Skeleton,
    stored: Mapping[str, HeaderTensor],
    base_prefix: str,
    tensor_block: Mapping[str, str],
    alias_source: Mapping[str, str],
    owners: _KeyOwnership,
) -> None:
    """The keys no module tensor claimed: a stored tied alias belongs to its source's block, anything else to its
    longest block prefix, and a key with neither is unmatched."""
    block_names = {b.name for b in skel.blocks}
    for key in stored:
        if key in owners.claimed:
            continue
        b, _ = _block_of_key(alias_source.get(key, key), tensor_block, block_names, base_prefix)
        if b is None:
            owners.unmatched.append(key)
            continue
        owners.keys_of.setdefault(b, []).append(key)


def _with_stored_dtypes(
    blocks: tuple[Block, ...], stored: Mapping[str, HeaderTensor], owners: _KeyOwnership
) -> tuple[list[Block], list[str]]:
    """The blocks with each tensor in the dtype the checkpoint stores it in (a fused tensor: its pieces' dtype),
    and a line for each tensor whose stored shape differs from the config's (the shape stays the config's)."""
    out = []
    shape_mismatches = []
    for blk in blocks:
        new_tensors = []
        for t in blk.tensors:
            k = owners.key_of_tensor.get(t.name)
            h = stored[k] if k is not None else None
            if h is not None:
                if h.shape != t.shape:
                    shape_mismatches.append(f"{t.name}: model {list(t.shape)}, checkpoint {list(h.shape)}")
                if h.dtype != t.dtype:
                    t = t._replace(dtype=h.dtype)
            elif t.name in owners.fused_dtype and owners.fused_dtype[t.name] != t.dtype:
                t = t._replace(dtype=owners.fused_dtype[t.name])
            new_tensors.append(t)
        out.append(Block(blk.name, tuple(new_tensors), blk.no_split, blk.layer_index, blk.is_head, blk.is_embedding))
    return out, shape_mismatches


def _needed_bytes(blocks: list[Block], in_ckpt: set[str]) -> int:
    """Bytes the model needs for what the checkpoint holds: its parameters, and the persistent buffers stored."""
    need = 0
    for blk in blocks:
        for t in blk.tensors:
            if t.kind in ("parameter", "packed") or (t.kind == "buffer" and t.name in in_ckpt):
                need += int(t.numel * DTYPE_BYTES[t.dtype])
    return need


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
