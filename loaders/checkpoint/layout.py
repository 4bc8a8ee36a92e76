"""Matching a model's tensors to a checkpoint's keys, and refusing a checkpoint that does not hold the model.

The mapping itself (identity, base-model prefix, fused MoE experts) is the planner's
(:mod:`planner.model.checkpoint_keys`); this module applies it to every tensor the model needs, checks the shapes
against the shards, and turns what is missing, unexpected or mis-shaped into one :class:`CheckpointError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from loaders.checkpoint.index import CheckpointIndex
from loaders.errors import CheckpointError, list_keys
from planner.model.checkpoint_keys import Index, TensorSource, piece_shape, tensor_source


def to_torch_index(index: Index) -> tuple:
    return tuple(slice(ix[0], ix[1]) if isinstance(ix, tuple) else ix for ix in index)


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
        src = tensor_source(name, tuple(shape), index, base_prefix)
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
