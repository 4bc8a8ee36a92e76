"""How each tensor of the module tree is assembled from checkpoint keys.

Most architectures store every parameter under its module name, and the mapping is the identity. Mixture-of-experts
models are the exception in transformers 5: the module holds *fused* expert tensors while checkpoints keep one
tensor per expert:

* Mixtral: ``block_sparse_moe.experts.N.w1/w3.weight`` ([I, H] each) become ``mlp.experts.gate_up_proj`` [E, 2I, H]
  with ``gate_up_proj[N] = cat(w1_N, w3_N)``; ``w2`` ([H, I]) becomes ``down_proj`` [E, H, I];
  the router ``block_sparse_moe.gate`` becomes ``mlp.gate``.
* Qwen2-MoE style: ``mlp.experts.N.gate_proj/up_proj/down_proj.weight`` fuse the same way.

Each target is described by :class:`TensorSource`: a list of pieces, each one checkpoint key written into an
index of the destination. The reader copies each piece straight into its slice of the destination tensor, so a
fused expert tensor is assembled without an intermediate stacked copy.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from loaders.errors import CheckpointError, list_keys
from loaders.safetensors_index import CheckpointIndex

#: A destination index: one entry per leading dim, an int (select) or a (start, stop) pair (slice).
Index = tuple


@dataclass(frozen=True)
class Piece:
    key: str
    index: Index = ()


@dataclass(frozen=True)
class TensorSource:
    """Where the module tensor ``name`` comes from. One piece with an empty index is a plain copy."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def is_plain(self) -> bool:
        return len(self.pieces) == 1 and self.pieces[0].index == ()


def piece_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """Shape of ``tensor[index]`` for a tensor of ``shape``."""
    out: list[int] = []
    for dim, ix in zip(shape, index):
        if isinstance(ix, tuple):
            out.append(ix[1] - ix[0])
    return tuple(out) + tuple(shape[len(index):])


def to_torch_index(index: Index) -> tuple:
    return tuple(slice(ix[0], ix[1]) if isinstance(ix, tuple) else ix for ix in index)


# Checkpoint spellings of fused expert tensors: (gate, up) pairs for gate_up_proj, and down.
_GATE_UP_NAMES = (("w1", "w3"), ("gate_proj", "up_proj"))
_DOWN_NAMES = ("w2", "down_proj")
_MOE_RENAMES = ((".mlp.", ".block_sparse_moe."),)


def _spellings(name: str, base_prefix: str) -> list[str]:
    """Checkpoint keys that may hold module tensor ``name``: itself, MoE-renamed, without the base-model prefix."""
    cands = [name]
    for new, old in _MOE_RENAMES:
        if new in name:
            cands.append(name.replace(new, old))
    if base_prefix and name.startswith(base_prefix + "."):
        cands += [c[len(base_prefix) + 1:] for c in list(cands)]
    return cands


def _fused_experts(name: str, shape: tuple[int, ...], index: CheckpointIndex, base_prefix: str) -> TensorSource | None:
    if len(shape) != 3:
        return None
    if name.endswith(".experts.gate_up_proj"):
        stem = name[: -len("gate_up_proj")]
        n_exp, two_i = shape[0], shape[1]
        half = two_i // 2
        for prefix in _spellings(stem, base_prefix):
            for gate, up in _GATE_UP_NAMES:
                keys_g = [f"{prefix}{e}.{gate}.weight" for e in range(n_exp)]
                keys_u = [f"{prefix}{e}.{up}.weight" for e in range(n_exp)]
                if all(k in index for k in keys_g + keys_u):
                    pieces = []
                    for e in range(n_exp):
                        pieces.append(Piece(keys_g[e], (e, (0, half))))
                        pieces.append(Piece(keys_u[e], (e, (half, two_i))))
                    return TensorSource(name, shape, tuple(pieces))
    elif name.endswith(".experts.down_proj"):
        stem = name[: -len("down_proj")]
        for prefix in _spellings(stem, base_prefix):
            for down in _DOWN_NAMES:
                keys = [f"{prefix}{e}.{down}.weight" for e in range(shape[0])]
                if all(k in index for k in keys):
                    return TensorSource(name, shape, tuple(Piece(k, (e,)) for e, k in enumerate(keys)))
    return None


def resolve_sources(
    wanted: dict[str, tuple[int, ...]],
    index: CheckpointIndex,
    *,
    base_prefix: str = "",
    ignore_unexpected: Iterable[str] = (),
    ignore_missing: Iterable[str] = (),
) -> dict[str, TensorSource]:
    """Map every wanted module tensor (name -> shape) to its checkpoint pieces, or raise listing what is wrong.

    Raises :class:`CheckpointError` for missing keys, unexpected keys (checkpoint tensors no module tensor uses,
    except those matching ``ignore_unexpected`` regexes) and shape mismatches, each listing the keys.
    """
    sources: dict[str, TensorSource] = {}
    missing: list[str] = []
    used: set[str] = set()
    ignore_missing_re = [re.compile(p) for p in ignore_missing]
    for name, shape in wanted.items():
        src = None
        for cand in _spellings(name, base_prefix):
            if cand in index:
                src = TensorSource(name, tuple(shape), (Piece(cand),))
                break
        if src is None:
            src = _fused_experts(name, tuple(shape), index, base_prefix)
        if src is None:
            if not any(r.search(name) for r in ignore_missing_re):
                missing.append(name)
            continue
        sources[name] = src
        used.update(p.key for p in src.pieces)

    ignore_re = [re.compile(p) for p in ignore_unexpected]
    unexpected = [k for k in index.keys() if k not in used and not any(r.search(k) for r in ignore_re)]
    mismatched = []
    for src in sources.values():
        for p in src.pieces:
            want = piece_shape(src.shape, p.index)
            have = index[p.key].shape
            if tuple(have) != tuple(want):
                mismatched.append(f"{p.key} (checkpoint {list(have)}, model {list(want)})")
    problems = []
    if missing:
        problems.append(f"missing keys (the model needs them, the checkpoint lacks them): {list_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): {list_keys(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {list_keys(mismatched)}")
    if problems:
        raise CheckpointError(
            f"The checkpoint in {index.root} does not match the model its config.json describes; "
            + "; ".join(problems)
            + ". Check that config.json belongs to these weights, or re-save the model."
        )
    return sources
