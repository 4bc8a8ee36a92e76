"""The offload folder: disk copies of tensors that cannot be served from the original shards.

Only tensors that must change on their way to disk land here (a dtype cast, a fused MoE tensor assembled from
per-expert keys); everything else is memory-mapped from the checkpoint itself. The folder holds one data file
(tensors back to back, 64-byte aligned) and ``index.json``, which records:

* the model's identity (its directory and a hash of its config.json) — a folder left by another model is refused;
* the run dtype and the source shards' sizes and mtimes — a stale folder (re-saved checkpoint, other dtype) is
  rewritten;
* each tensor's byte range, dtype and shape, and the data file's own size — a truncated data file is rewritten.

Writes are atomic: the old index is removed first, the data file is written under a temporary name, fsynced and
renamed, and only then is the index written (temporary name + rename). A run killed at any point leaves either
no index (the next run rewrites) or a complete folder.

Before writing, the folder's file system must have room for every byte the write needs (refused otherwise with
the folder, the bytes needed and the bytes free: :class:`OffloadSpaceError`); a write that fails anyway (a full or
shrinking disk, a file-size limit, an error or interrupt of the run) removes its temporary files before the error
goes on, so a failed load never leaves the disk fuller than it found it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from loaders.checkpoint.index import SAFETENSORS_DTYPES, ShardEntry, ShardFile
from loaders.checkpoint.shard_reader import byte_view
from loaders.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT = "loadmaster-offload/1"
INDEX = "index.json"
DATA = "tensors.bin"
ALIGN = 64
#: Room kept for index.json besides the data file: a fixed part and a share per tensor (its name, shape, range).
INDEX_RESERVE = 64 * 1024
INDEX_BYTES_PER_TENSOR = 512
_DTYPE_TAGS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def _config_digest(model_path: Path) -> str:
    cfg = (model_path if model_path.is_dir() else model_path.parent) / "config.json"
    try:
        return hashlib.sha256(cfg.read_bytes()).hexdigest()
    except OSError:
        return ""


class OffloadSpaceError(CheckpointError):
    """The offload folder's file system has not enough free space for the tensors the plan puts there."""


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def data_bytes(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The size of the data file these tensors make (sorted by name, each 64-byte aligned)."""
    pos = 0
    for name in sorted(specs):
        shape, dtype = specs[name]
        pos += (-pos) % ALIGN
        n = 1
        for d in shape:
            n *= int(d)
        pos += n * dtype.itemsize
    return pos


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class OffloadFolder:
    def __init__(self, path: Path, *, model_path: Path, dtype: torch.dtype, sources: list[ShardFile]):
        self.path = Path(path)
        self.model = {"path": str(Path(model_path).resolve()), "config_sha256": _config_digest(Path(model_path))}
        self.dtype = str(dtype).removeprefix("torch.")
        self.sources = [{"name": Path(s.path).name, "size": s.size, "mtime_ns": s.mtime_ns} for s in sources]
        self._index: dict | None = None

    # -- reading ---------------------------------------------------------------------------------------
    def _read_index(self) -> dict | None:
        p = self.path / INDEX
        if not p.is_file():
            return None
        try:
            data = json.loads(p.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            return data
        except (ValueError, OSError, AttributeError) as exc:
            raise CheckpointError(
                f"Offload folder {self.path} has an index.json this loader cannot read ({exc}). It was not written "
                "by loadmaster; pass another offload_folder or empty this one."
            ) from exc

    def is_valid_for(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> bool:
        """True when the folder already holds exactly these tensors for this model, dtype and checkpoint.

        Raises CheckpointError when the folder belongs to another model (never overwritten silently).
        """
        index = self._read_index()
        if index is None:
            leftovers = [p.name for p in self.path.glob("*.tmp")] if self.path.is_dir() else []
            if leftovers:
                log.warning("offload folder %s holds an interrupted run's files (%s); rewriting", self.path, leftovers)
            return False
        if index.get("model") != self.model:
            other = (index.get("model") or {}).get("path", "an unknown model")
            raise CheckpointError(
                f"Offload folder {self.path} belongs to another model ({other}). Pass a different offload_folder "
                "for this model, or delete that folder if it is no longer needed."
            )
        why = None
        if index.get("dtype") != self.dtype:
            why = f"it was written for dtype {index.get('dtype')}, this run uses {self.dtype}"
        elif index.get("sources") != self.sources:
            why = "the checkpoint's shards changed since it was written (sizes or mtimes differ)"
        else:
            tensors = index.get("tensors", {})
            if set(tensors) != set(specs):
                why = "it holds a different set of tensors (another device map)"
            else:
                for name, (shape, dtype) in specs.items():
                    t = tensors[name]
                    if tuple(t["shape"]) != tuple(shape) or t["dtype"] != _DTYPE_TAGS[dtype]:
                        why = f"tensor {name} has another shape or dtype"
                        break
            data = self.path / DATA
            if why is None and (not data.is_file() or data.stat().st_size != index.get("data_size")):
                why = "its data file is missing or has the wrong size"
        if why:
            log.warning("offload folder %s is stale (%s); rewriting", self.path, why)
            return False
        self._index = index
        return True

    def entries(self) -> dict[str, ShardEntry]:
        if self._index is None:
            self._index = self._read_index()
        if self._index is None:
            return {}
        data = str(self.path / DATA)
        return {
            name: ShardEntry(name, data, SAFETENSORS_DTYPES[t["dtype"]], tuple(t["shape"]), t["start"], t["end"])
            for name, t in self._index["tensors"].items()
        }

    # -- writing ---------------------------------------------------------------------------------------
    def write(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], produce: Callable[[str], torch.Tensor]
    ) -> int:
        """Write every tensor ``produce(name)`` returns, then the index. Returns the bytes written.

        Refuses (:class:`OffloadSpaceError`) when the file system cannot hold them; on any failure the temporary
        files are removed before the error goes on."""
        self.path.mkdir(parents=True, exist_ok=True)
        # from here on, nothing here looks complete until the new index lands; the old data goes too, so that its
        # space counts as free
        for stale in (self.path / INDEX, self.path / DATA, *self.path.glob("*.tmp")):
            stale.unlink(missing_ok=True)
        needed = data_bytes(specs) + INDEX_RESERVE + len(specs) * INDEX_BYTES_PER_TENSOR
        free = free_bytes(self.path)
        if needed > free:
            raise OffloadSpaceError(self._no_room(needed, free))
        tmp_data = self.path / f"{DATA}.{os.getpid()}.tmp"
        tmp_index = self.path / f"{INDEX}.{os.getpid()}.tmp"
        try:
            return self._write(specs, produce, tmp_data, tmp_index)
        except BaseException as exc:
            for tmp in (tmp_data, tmp_index):
                tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise OffloadSpaceError(
                    self._no_room(needed, free_bytes(self.path)) + f" (writing failed: {exc.strerror})"
                ) from exc
            raise

    def _no_room(self, needed: int, free: int) -> str:
        return (
            f"The offload folder {self.path} needs {_size(needed)} ({needed} bytes) for the tensors the plan puts on "
            f"disk, and its file system has {_size(free)} ({free} bytes) free. Free space there, pass another "
            "offload_folder (--offload-folder), or give the plan more memory so that fewer tensors go to disk."
        )

    def _write(self, specs, produce, tmp_data: Path, tmp_index: Path) -> int:  # noqa: ANN001
        tensors: dict[str, dict] = {}
        pos = 0
        with open(tmp_data, "wb") as f:
            for name in sorted(specs):
                t = produce(name).contiguous()
                if t.dtype != specs[name][1] or tuple(t.shape) != tuple(specs[name][0]):
                    raise AssertionError(f"offload producer returned the wrong tensor for {name}")
                pad = (-pos) % ALIGN
                if pad:
                    f.write(b"\0" * pad)
                    pos += pad
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    f.write(byte_view(t))
                tensors[name] = {
                    "dtype": _DTYPE_TAGS[t.dtype],
                    "shape": list(t.shape),
                    "start": pos,
                    "end": pos + nbytes,
                }
                pos += nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_data, self.path / DATA)
        index = {
            "format": FORMAT,
            "model": self.model,
            "dtype": self.dtype,
            "sources": self.sources,
            "data_size": pos,
            "tensors": tensors,
        }
        with open(tmp_index, "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_index, self.path / INDEX)
        try:
            dir_fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass
        self._index = index
        log.info("wrote %d tensors (%d bytes) to offload folder %s", len(tensors), pos, self.path)
        return pos
