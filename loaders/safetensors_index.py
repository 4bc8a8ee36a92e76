"""Where every tensor of a checkpoint lives: file, byte range, dtype and shape, validated before any load.

Reads ``model.safetensors.index.json`` (or a single ``model.safetensors``) and each shard's header. Every check
that can fail on a bad checkpoint runs here, before a single weight is allocated: an index naming a missing
file, a header that is not JSON or whose length is wrong, a tensor whose byte range leaves the file (a shard
truncated mid-tensor) or disagrees with its dtype and shape.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from loaders.errors import CheckpointError, list_keys

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

#: safetensors dtype tags -> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class ShardEntry:
    """One tensor's place on disk: absolute byte range ``[start, end)`` in ``file``."""

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardFile:
    """A shard's identity as the offload folder records it (size and mtime catch a re-saved checkpoint)."""

    path: str
    size: int
    mtime_ns: int


class CheckpointIndex:
    """All tensors of a checkpoint directory, by key. Construct with :meth:`open`."""

    def __init__(self, root: Path, entries: dict[str, ShardEntry], files: list[ShardFile], metadata: dict):
        self.root = root
        self.entries = entries
        self.files = files
        self.metadata = metadata

    @classmethod
    def open(cls, path: str | os.PathLike) -> "CheckpointIndex":
        root = Path(path)
        weight_map: dict[str, str] = {}
        if root.is_file():
            shard_names = [root.name]
            root = root.parent
        elif (root / INDEX_NAME).is_file():
            weight_map = _read_weight_map(root / INDEX_NAME)
            shard_names = list(dict.fromkeys(weight_map.values()))
        elif (root / SINGLE_NAME).is_file():
            shard_names = [SINGLE_NAME]
        else:
            found = sorted(p.name for p in root.glob("*.safetensors")) if root.is_dir() else []
            if len(found) == 1:
                shard_names = found
            else:
                raise CheckpointError(
                    f"No safetensors weights in {root}: expected {INDEX_NAME} or {SINGLE_NAME}"
                    + (f" (found {len(found)} .safetensors files but no index naming them)" if found else "")
                    + ". Save the model with save_pretrained(..., safe_serialization=True)."
                )
        entries: dict[str, ShardEntry] = {}
        files: list[ShardFile] = []
        metadata: dict = {}
        for name in shard_names:
            shard = root / name
            if not shard.is_file():
                raise CheckpointError(
                    f"{INDEX_NAME} in {root} names {name}, which does not exist. The checkpoint is incomplete: "
                    "copy or download the missing shard, or re-save the model."
                )
            st = shard.stat()
            files.append(ShardFile(str(shard), st.st_size, st.st_mtime_ns))
            shard_entries, meta = read_shard_header(shard)
            metadata.update(meta)
            for key, e in shard_entries.items():
                if key in entries:
                    raise CheckpointError(f"Tensor {key!r} is stored twice: in {Path(entries[key].file).name} and "
                                          f"{shard.name}. Re-save the checkpoint.")
                entries[key] = e
        misplaced = [k for k, f in weight_map.items() if k not in entries or Path(entries[k].file).name != f]
        if misplaced:
            raise CheckpointError(
                f"{INDEX_NAME} in {root} places tensors in shards that do not hold them: {list_keys(misplaced)}. "
                "The index and the shards come from different saves; re-save the model."
            )
        return cls(root, entries, files, metadata)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> ShardEntry:
        return self.entries[key]

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def first_float_dtype(self) -> torch.dtype | None:
        for e in self.entries.values():
            if e.dtype.is_floating_point:
                return e.dtype
        return None


def _read_weight_map(index_path: Path) -> dict[str, str]:
    try:
        data = json.loads(index_path.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_path} is not a valid safetensors index ({exc}). Re-save the model.") from exc
    return {str(k): str(v) for k, v in weight_map.items()}


def read_shard_header(path: Path) -> tuple[dict[str, ShardEntry], dict]:
    """Parse and validate one shard's header against the file's real size. Reads the header bytes only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is {size} bytes: too short to be a safetensors file (truncated?).")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{path} has a corrupt header: it declares {n} header bytes but the file holds {size} bytes. "
                "The file is truncated or not safetensors; re-download or re-save it."
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} has a corrupt header ({exc}). Re-download or re-save it.") from exc
    data_start = 8 + n
    meta = header.pop("__metadata__", None) or {}
    entries: dict[str, ShardEntry] = {}
    for key, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, stop = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: header entry for {key!r} is malformed ({exc}).") from exc
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if begin < 0 or stop < begin or stop - begin != expected:
            raise CheckpointError(
                f"{path}: tensor {key!r} has byte range [{begin}, {stop}) but dtype {info['dtype']} and shape "
                f"{list(shape)} need {expected} bytes. The header is corrupt; re-save the checkpoint."
            )
        if data_start + stop > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {key!r} ends at byte {data_start + stop} but the file has {size} bytes. "
                "Re-download or re-save this shard."
            )
        entries[key] = ShardEntry(key, str(path), dtype, shape, data_start + begin, data_start + stop)
    return entries, meta
