"""Real safetensors files whose data region is a hole: full-size checkpoints that cost a few MB of disk.

Tests of header reading and of planning real architectures need checkpoints of 7B-70B models on disk. The headers
here are real (the same layout the reference writer produces), the data is zeros that ``os.truncate`` leaves
unallocated, so readers see a valid file. Test-only: nothing in the packages writes checkpoints this way.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from planner.model.safetensors_header import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME
from planner.types import DTYPE_BYTES

#: Dtype names of :data:`planner.types.DTYPE_BYTES` -> safetensors dtype codes.
DTYPE_CODES: dict[str, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def encode_header(
    entries: Mapping[str, tuple[str, Iterable[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, int]:
    """Lay out tensors back to back; return (8-byte length + padded JSON, data region length)."""
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for name, (dtype, shape) in entries.items():
        shape = [int(d) for d in shape]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = int(numel * DTYPE_BYTES[dtype])
        doc[name] = {"dtype": DTYPE_CODES[dtype], "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data region to 8 bytes
    return struct.pack("<Q", len(raw)) + raw, pos


def write_sparse_checkpoint(
    directory: str | os.PathLike,
    tensors: Mapping[str, tuple[str, Iterable[int]]],
    shards: int = 1,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write a real, valid safetensors checkpoint whose data region is a hole (all zeros, no disk blocks).

    ``tensors`` maps name -> (dtype name, shape), in order. With ``shards > 1`` tensors are split into that many
    files of roughly equal bytes (``model-0000i-of-0000n.safetensors``) plus ``model.safetensors.index.json``;
    with one shard a single ``model.safetensors``. The files are sized with ``os.truncate`` so a 140 GB
    checkpoint costs a few MB of disk; readers see zeros.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = [(n, (dt, tuple(int(d) for d in sh))) for n, (dt, sh) in tensors.items()]
    shards = max(1, min(int(shards), len(items) or 1))
    sizes = []
    for _, (dt, sh) in items:
        numel = 1
        for d in sh:
            numel *= d
        sizes.append(int(numel * DTYPE_BYTES[dt]))
    total = sum(sizes)
    groups: list[list[tuple[str, tuple[str, tuple[int, ...]]]]] = [[] for _ in range(shards)]
    acc, g = 0, 0
    for i, (item, nbytes) in enumerate(zip(items, sizes)):
        # move on once this shard holds its share, and always leave at least one tensor for each later shard
        left_after = len(items) - i
        if g < shards - 1 and groups[g] and (acc >= total * (g + 1) / shards or left_after <= shards - 1 - g):
            g += 1
        groups[g].append(item)
        acc += nbytes
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = SINGLE_NAME if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        head, data_len = encode_header(dict(group), metadata if shards == 1 else {"format": "pt"})
        p = directory / fname
        with open(p, "wb") as f:
            f.write(head)
        os.truncate(p, len(head) + data_len)
        paths.append(p)
        for name, _ in group:
            weight_map[name] = fname
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return paths
