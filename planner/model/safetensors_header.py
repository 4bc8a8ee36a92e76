"""Safetensors headers, read without touching weight data.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, then ``N`` bytes of JSON, then the data
region. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the start of the data region) and may hold a ``"__metadata__"`` object of strings. The planner needs only the JSON:
names, dtypes, shapes and where each tensor lies. Reading it costs one small read per shard, so the ~30 shards of a
70B checkpoint are read in milliseconds however large their data region is.

Everything here is pure Python (no torch, no ``safetensors`` import) so the planner core can use it freely, and every
validation failure raises :class:`HeaderError` with the file named, so a user knows which shard to re-download.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import HeaderError, ModelSourceError
from planner.types import DTYPE_BYTES

log = logging.getLogger(__name__)

#: Safetensors dtype codes -> the dtype names of :data:`planner.types.DTYPE_BYTES`.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}

#: Largest header we accept. The reference implementation refuses headers above 100 MB; a real 150k-tensor header
#: is ~15 MB, so anything larger is a corrupt length field, not a big model.
MAX_HEADER_BYTES = 100 * 1024 * 1024

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Pickle-based weight files we refuse to read (unpickling runs arbitrary code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor entry of a safetensors header. ``offset`` is absolute (from the start of the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    file: str  # the shard's file name (not the full path), as an index's weight_map names it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed, validated header of one file. ``tensors`` keeps the order of the JSON."""

    path: Path
    tensors: dict[str, HeaderTensor]
    metadata: dict[str, str]
    data_start: int
    file_size: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True)
class CheckpointHeaders:
    """Every tensor of a checkpoint directory, by name, with the shard that holds it."""

    directory: Path
    files: tuple[SafetensorsHeader, ...]
    tensors: dict[str, HeaderTensor]
    #: ``weight_map`` of the index when there is one (key -> file name); else built from the files.
    weight_map: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return out


def _fail(path: Path, what: str) -> HeaderError:
    return HeaderError(
        f"{path}: corrupt or truncated safetensors header: {what}. "
        "Re-download or re-save this file (e.g. with save_pretrained(..., safe_serialization=True))."
    )


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of one ``.safetensors`` file; never reads the data region.

    Checks: the length prefix is present and fits the file; the JSON is an object of well-formed entries with known
    dtypes; each entry's byte span equals ``prod(shape) * itemsize`` and lies inside the data region; no two
    tensors overlap.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"the file is {size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n == 0 or n > MAX_HEADER_BYTES:
                raise _fail(path, f"the header length field says {n} bytes, which is not a plausible header size")
            if 8 + n > size:
                raise _fail(path, f"the header length field says {n} bytes but the file has only {size - 8} after it")
            raw = f.read(n)
    except FileNotFoundError:
        raise ModelSourceError(f"{path}: safetensors file not found") from None
    except IsADirectoryError:
        raise ModelSourceError(f"{path}: is a directory, expected a .safetensors file") from None
    if len(raw) != n:
        raise _fail(path, f"read {len(raw)} header bytes of {n} (file changed while reading?)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _fail(path, f"the header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _fail(path, f"the header is JSON {type(doc).__name__}, expected an object of tensor entries")
    return _parse_entries(path, doc, data_start=8 + n, file_size=size)


def _parse_entries(path: Path, doc: dict, data_start: int, file_size: int) -> SafetensorsHeader:
    data_len = file_size - data_start
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _fail(path, "__metadata__ is not an object")
    tensors: dict[str, HeaderTensor] = {}
    spans: list[tuple[int, int, str]] = []
    fname = path.name
    for name, entry in doc.items():
        if not isinstance(entry, dict):
            raise _fail(path, f"entry {name!r} is not an object")
        code, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        dtype = SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise _fail(
                path, f"tensor {name!r} has unknown dtype {code!r} (known: {', '.join(sorted(SAFETENSORS_DTYPES))})"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _fail(path, f"tensor {name!r} has shape {shape!r}, expected a list of non-negative integers")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise _fail(path, f"tensor {name!r} has data_offsets {offs!r}, expected [begin, end]")
        begin, end = offs
        if begin < 0 or end < begin:
            raise _fail(path, f"tensor {name!r} has data_offsets [{begin}, {end}], which is not a valid span")
        if end > data_len:
            raise _fail(
                path,
                f"tensor {name!r} ends at data byte {end} but the data region has only {data_len} bytes "
                "(the file is truncated or the offsets are wrong)",
            )
        numel = 1
        for d in shape:
            numel *= d
        expected = int(numel * DTYPE_BYTES[dtype])
        if end - begin != expected:
            raise _fail(
                path, f"tensor {name!r} spans {end - begin} bytes but shape {shape} of {dtype} needs {expected}"
            )
        tensors[name] = HeaderTensor(name, dtype, tuple(shape), data_start + begin, end - begin, fname)
        spans.append((begin, end, name))
    spans.sort()
    prev_end, prev_name = 0, None
    for begin, end, name in spans:
        if begin < prev_end and end > begin:  # zero-size tensors may sit anywhere
            raise _fail(path, f"tensors {prev_name!r} and {name!r} overlap (bytes {begin}..{prev_end})")
        if end > prev_end:
            prev_end, prev_name = end, name
    return SafetensorsHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()}, data_start, file_size)


def _check_shard_inside(directory: Path, index: Path, name: str) -> None:
    """A shard named by an index must be a file of the checkpoint directory: no absolute path, no ``..``, and once
    symlinks are resolved it must lie in the directory, or in the Hub cache's ``blobs`` folder of the same
    repository (where a snapshot's links point). Anything else would read a file the server was not given."""
    if os.path.isabs(name) or ".." in Path(name).parts or "\x00" in name:
        raise ModelSourceError(f"{index} names shard {name!r} outside the checkpoint directory; refused")
    real = (directory / name).resolve()
    here = directory.resolve()
    blobs = (directory.parent.parent / "blobs").resolve()
    if not (real.is_relative_to(here) or (directory.parent.name == "snapshots" and real.is_relative_to(blobs))):
        raise ModelSourceError(f"{index}: shard {name!r} is a link that leads outside the checkpoint; refused")


def find_weight_files(directory: str | os.PathLike) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a checkpoint directory, and the index's weight_map (empty without an index).

    Order of preference: ``model.safetensors.index.json`` (every shard it names must exist), a single
    ``model.safetensors``, then every ``*.safetensors`` in the directory. Pickle files are never used.
    """
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ModelSourceError(f"{index}: cannot read the safetensors index ({e}); re-download it") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelSourceError(f"{index}: has no 'weight_map' object naming the shard of each tensor")
        files = list(dict.fromkeys(str(v) for v in weight_map.values()))
        for f in files:
            _check_shard_inside(directory, index, f)
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise ModelSourceError(
                f"{index} names shard file(s) that are missing from {directory}: {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                + ". Download the missing shards (or remove the stale index)."
            )
        return [directory / f for f in files], {str(k): str(v) for k, v in weight_map.items()}
    single = directory / SINGLE_NAME
    if single.is_file():
        _check_shard_inside(directory, single, SINGLE_NAME)
        return [single], {}
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    for f in files:
        _check_shard_inside(directory, f, f.name)
    if files:
        return files, {}
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    msg = (
        f"{directory}: no safetensors weights found (expected {INDEX_NAME} with its shards, "
        f"{SINGLE_NAME}, or *.safetensors files)"
    )
    if pickles:
        msg += (
            f". Found pickle weight files ({', '.join(pickles[:3])}), which loadmaster refuses to read because "
            "unpickling can run arbitrary code; convert them to safetensors first"
        )
    raise ModelSourceError(msg)


def has_weight_files(directory: str | os.PathLike) -> bool:
    """True when :func:`find_weight_files` would find something (the index or any ``*.safetensors``)."""
    d = Path(directory)
    return (d / INDEX_NAME).is_file() or any(d.glob("*.safetensors"))


def read_checkpoint_headers(directory: str | os.PathLike) -> CheckpointHeaders:
    """Read the headers of every shard of a checkpoint directory (see :func:`find_weight_files`).

    With an index, each key of its weight_map must be in the header of the shard it names; a tensor stored in two
    shards is an error. Keys present in a shard but absent from the index are kept (transformers loads them too).
    """
    directory = Path(directory)
    files, weight_map = find_weight_files(directory)
    headers = [read_header(p) for p in files]
    tensors: dict[str, HeaderTensor] = {}
    metadata: dict[str, str] = {}
    for h in headers:
        metadata.update(h.metadata)
        for name, t in h.tensors.items():
            other = tensors.get(name)
            if other is not None:
                raise ModelSourceError(
                    f"{directory}: tensor {name!r} is stored in both {other.file} and {t.file}; remove the stale shard"
                )
            tensors[name] = t
    for key, fname in weight_map.items():
        t = tensors.get(key)
        if t is None or t.file != fname:
            raise ModelSourceError(
                f"{directory / INDEX_NAME}: says {key!r} is in {fname}, but "
                + ("no shard holds it" if t is None else f"it is in {t.file}")
                + "; the index and the shards disagree (re-download them together)"
            )
    if not weight_map:
        weight_map = {name: t.file for name, t in tensors.items()}
    return CheckpointHeaders(directory, tuple(headers), tensors, weight_map, metadata)
