"""Where every tensor of a checkpoint lives: file, byte range, dtype and shape, validated before any load.

Header parsing and validation is the planner's (``planner.model.safetensors_header``: pure, reads headers only); this
module turns its answer into what the loader reads with (absolute byte ranges, torch dtypes, the shards' sizes and
mtimes for the offload folder's index) and re-raises its errors as :class:`CheckpointError`, since at load time a
bad header means a bad checkpoint. Every check runs here, before a single weight is allocated: an index naming a
missing file, a header that is not JSON or whose length is wrong, a tensor whose byte range leaves the file (a shard
truncated mid-tensor) or disagrees with its dtype and shape.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loaders.errors import CheckpointError
from planner.errors import ModelSourceError
from planner.model.safetensors_header import SAFETENSORS_DTYPES as _CODE_TO_NAME
from planner.model.safetensors_header import CheckpointHeaders, read_checkpoint_headers

#: safetensors dtype codes -> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in _CODE_TO_NAME.items()}


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
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardFile:
    """A shard's identity as the offload folder records it (size and mtime catch a re-saved checkpoint)."""

    path: str
    size: int
    mtime_ns: int


class CheckpointIndex:
    """All tensors of a checkpoint, by key. Construct with :meth:`open`."""

    def __init__(
        self,
        root: Path,
        entries: dict[str, ShardEntry],
        files: list[ShardFile],
        metadata: dict,
        headers: CheckpointHeaders,
    ):
        self.root = root
        self.entries = entries
        self.files = files
        self.metadata = metadata
        #: The planner's validated headers this index was made from (what ``describe_checkpoint`` reads too).
        self.headers = headers

    @classmethod
    def open(cls, path: str | os.PathLike) -> CheckpointIndex:
        """Read and validate every header of a checkpoint directory (or of the directory of one shard)."""
        root = Path(path)
        root = root.parent if root.is_file() else root
        try:
            headers = read_checkpoint_headers(root)
        except ModelSourceError as exc:  # HeaderError is a ModelSourceError
            raise CheckpointError(str(exc)) from exc
        return cls.from_headers(headers)

    @classmethod
    def from_headers(cls, headers: CheckpointHeaders) -> CheckpointIndex:
        """The index of a checkpoint whose headers the planner has already read and validated."""
        entries: dict[str, ShardEntry] = {}
        files: list[ShardFile] = []
        metadata: dict = {}
        for h in headers.files:
            try:
                st = os.stat(h.path)
            except OSError as exc:
                raise CheckpointError(f"{h.path} is gone since its header was read ({exc}); load again.") from exc
            files.append(ShardFile(str(h.path), h.file_size, st.st_mtime_ns))
            metadata.update(h.metadata)
            for name, t in h.tensors.items():
                entries[name] = ShardEntry(
                    name, str(h.path), getattr(torch, t.dtype), t.shape, t.offset, t.offset + t.nbytes
                )
        return cls(Path(headers.directory), entries, files, metadata, headers)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> ShardEntry:
        return self.entries[key]

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
