"""Which checkpoint keys hold each tensor of the module tree: the one mapping, for the planner and the loader.

Most architectures store every tensor under its module name, and the mapping is the identity (or the name without
the model's ``base_model_prefix``: old GPT-2 checkpoints store ``h.0...``). Mixture-of-experts models are the
exception in transformers 5: the module holds *fused* expert tensors while checkpoints keep one tensor per expert:

* Mixtral: ``block_sparse_moe.experts.N.w1/w3.weight`` ([I, H] each) become ``mlp.experts.gate_up_proj`` [E, 2I, H]
  with ``gate_up_proj[N] = cat(w1_N, w3_N)``; ``w2`` ([H, I]) becomes ``down_proj`` [E, H, I]; the router
  ``block_sparse_moe.gate`` becomes ``mlp.gate``.
* Qwen2-MoE style: ``mlp.experts.N.gate_proj/up_proj/down_proj.weight`` fuse the same way.

Each module tensor maps to a :class:`TensorSource`: pieces, each one checkpoint key written into an index of the
destination. Plain data, no torch: the planner reads it to know which block a stored key belongs to, the loader
to copy each piece straight into its slice of the destination tensor.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

#: A destination index: one entry per leading dim, an int (select) or a (start, stop) pair (slice).
Index = tuple

# The MoE tables. Checkpoint spellings of fused expert tensors: (gate, up) pairs for gate_up_proj, and down;
# module-path renames (transformers 5 name -> checkpoint name).
GATE_UP_NAMES = (("w1", "w3"), ("gate_proj", "up_proj"))
DOWN_NAMES = ("w2", "down_proj")
MOE_RENAMES = ((".mlp.", ".block_sparse_moe."),)


@dataclass(frozen=True)
class Piece:
    """One checkpoint key, written into ``index`` of the destination tensor (``()``: the whole tensor)."""

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
    for _dim, ix in zip(shape, index):
        if isinstance(ix, tuple):
            out.append(ix[1] - ix[0])
    return tuple(out) + tuple(shape[len(index) :])


def spellings(name: str, base_prefix: str) -> list[str]:
    """Checkpoint keys that may hold module tensor ``name``: itself, MoE-renamed, without the base-model prefix."""
    cands = [name]
    for new, old in MOE_RENAMES:
        if new in name:
            cands.append(name.replace(new, old))
    if base_prefix and name.startswith(base_prefix + "."):
        cands += [c[len(base_prefix) + 1 :] for c in list(cands)]
    return cands


def _fused_experts(name: str, shape: tuple[int, ...], stored: Container[str], base_prefix: str) -> TensorSource | None:
    if len(shape) != 3:
        return None
    if name.endswith(".experts.gate_up_proj"):
        stem = name[: -len("gate_up_proj")]
        n_exp, two_i = shape[0], shape[1]
        half = two_i // 2
        for prefix in spellings(stem, base_prefix):
            for gate, up in GATE_UP_NAMES:
                keys_g = [f"{prefix}{e}.{gate}.weight" for e in range(n_exp)]
                keys_u = [f"{prefix}{e}.{up}.weight" for e in range(n_exp)]
                if all(k in stored for k in keys_g + keys_u):
                    pieces = []
                    for e in range(n_exp):
                        pieces.append(Piece(keys_g[e], (e, (0, half))))
                        pieces.append(Piece(keys_u[e], (e, (half, two_i))))
                    return TensorSource(name, shape, tuple(pieces))
    elif name.endswith(".experts.down_proj"):
        stem = name[: -len("down_proj")]
        for prefix in spellings(stem, base_prefix):
            for down in DOWN_NAMES:
                keys = [f"{prefix}{e}.{down}.weight" for e in range(shape[0])]
                if all(k in stored for k in keys):
                    return TensorSource(name, shape, tuple(Piece(k, (e,)) for e, k in enumerate(keys)))
    return None


def tensor_source(
    name: str, shape: tuple[int, ...], stored: Container[str], base_prefix: str = ""
) -> TensorSource | None:
    """The checkpoint pieces of module tensor ``name`` (of ``shape``) among the ``stored`` keys, or None."""
    shape = tuple(shape)
    for cand in spellings(name, base_prefix):
        if cand in stored:
            return TensorSource(name, shape, (Piece(cand),))
    return _fused_experts(name, shape, stored, base_prefix)


__all__ = ["Piece", "TensorSource", "piece_shape", "spellings", "tensor_source"]
