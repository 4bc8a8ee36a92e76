"""Fetching a Hub model into the shared Hugging Face cache: only what loading needs, resumable, with progress.

Two steps, so that every refusal happens before a byte of weights moves:

* :func:`prepare_download` asks the Hub for the revision's commit and file list, refuses pickled-only repositories,
  checks access (a gated repository answers 401/403 on its files, not on its listing) and checks that the disk
  holding ``HF_HOME`` has room for the files still missing. Offline (``HF_HUB_OFFLINE=1``) or with the Hub
  unreachable it uses the cached snapshot, or says there is none.
* :func:`download` fetches each missing file with huggingface_hub's own ``http_get`` into a partial file with a
  stable name next to the blob, so an interrupted run (killed process, dropped connection) resumes with an HTTP
  range request where it stopped. (huggingface_hub 1.x+ writes to a per-process temporary name and deletes it on
  failure, so its own downloads restart from zero after an interruption.) The finished blob is then linked into
  ``snapshots/<commit>/`` by ``hf_hub_download`` itself, so the cache stays the standard layout that every other
  tool (and a later ``HF_HUB_OFFLINE=1`` start) reads.

What is fetched: ``*.safetensors``, their index, ``config.json``, ``generation_config.json`` and the tokenizer
files, at the top level of the repository. Never ``*.bin``/``*.pt``: loadmaster does not unpickle.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from planner.hardware.units import format_bytes
from planner.model.model_ref import (
    CONFIG_NAME,
    HubError,
    HubRef,
    HubRevision,
    cached_snapshot_of,
    hub_call,
    parse_model_ref,
    refuse_pickled_only,
    resolve_revision,
)

log = logging.getLogger(__name__)

#: Top-level files loading needs. Everything else in a repository (pickles, ONNX, GGUF, images) stays on the Hub.
SERVE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
PARTIAL_SUFFIX = ".loadmaster-partial"
#: Seconds between progress lines on the terminal.
LOG_EVERY_S = 1.0


@dataclass(frozen=True)
class DownloadProgress:
    """One progress update: the same fields the loader's progress has, plus the transfer rate."""

    phase: str
    bytes_done: int
    bytes_total: int
    rate: float  # bytes per second transferred in this run (resumed bytes excluded)
    file: str = ""


@dataclass(frozen=True)
class HubDownload:
    """What :func:`download` will fetch: checked, sized, and known to fit."""

    revision: HubRevision
    #: file name -> size, every file loading needs (already cached ones included)
    files: dict[str, int]
    #: bytes of those files not in the cache yet
    missing_bytes: int


@dataclass(frozen=True)
class HubSnapshot:
    """A model in the cache, ready to load: its folder (``snapshots/<commit>``), the reference and the commit."""

    path: Path
    ref: HubRef
    commit: str


def wanted(filename: str) -> bool:
    return "/" not in filename and any(fnmatch.fnmatch(filename, p) for p in SERVE_PATTERNS)


def _storage_folder(repo_id: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_disk(ref: HubRef, need: int) -> None:
    """Refuse before downloading when the disk holding the Hub cache has less free space than ``need`` bytes."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    free = shutil.disk_usage(_existing_parent(cache)).free
    if need > free:
        raise HubError(
            f"not enough disk for {ref}: its weights, config and tokenizer need {format_bytes(need)} "
            f"more, and {cache} has {format_bytes(free)} free; free space there or set HF_HOME to a "
            "bigger disk"
        )


def prepare_download(ref: HubRef) -> HubDownload:
    """Resolve ``ref``, refuse what cannot be served, and check access and disk space; download nothing."""
    rev = resolve_revision(ref, what="listing the repository's files")
    if rev.cached_snapshot is not None:
        return HubDownload(rev, {f: int(s or 0) for f, s in rev.files.items() if wanted(f)}, 0)
    refuse_pickled_only(rev)
    if CONFIG_NAME not in rev.files:
        raise HubError(
            f"{ref} has no config.json, so loadmaster cannot build its model; it serves transformers "
            "causal language models"
        )
    files = {f: int(s or 0) for f, s in rev.files.items() if wanted(f)}
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    # A gated repository lists its files to anyone but refuses them without a (granted) token: ask now.
    hub_call(
        ref,
        "reading config.json",
        lambda: get_hf_file_metadata(hf_hub_url(ref.repo_id, CONFIG_NAME, revision=rev.commit)),
    )
    snapshot = _storage_folder(ref.repo_id) / "snapshots" / rev.commit
    missing = 0
    for name, size in files.items():
        if (snapshot / name).exists():
            continue
        missing += size
    check_disk(ref, missing)
    return HubDownload(rev, files, missing)


class _Meter:
    """Counts bytes across the files of one download; reports to a callback and, once a second, to the log."""

    def __init__(self, ref: HubRef, total: int, progress: Callable[[DownloadProgress], None] | None):
        self.ref = ref
        self.total = total
        self.progress = progress
        self.finished = 0  # bytes of files done (cached or fetched)
        self.current = 0  # bytes of the file in flight, resumed part included
        self.resumed = 0  # bytes of the file in flight that were on disk before this run
        self.transferred = 0  # bytes received in this run, for the rate
        self.file = ""
        self.t0 = time.monotonic()
        self.last_log = 0.0
        self.lock = threading.Lock()

    @property
    def done(self) -> int:
        return self.finished + self.current

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.t0
        return self.transferred / elapsed if elapsed > 0 else 0.0

    def start_file(self, name: str, on_disk: int) -> None:
        self.file, self.current, self.resumed = name, on_disk, on_disk
        if on_disk:
            log.info("resuming %s of %s at %s", name, self.ref, format_bytes(on_disk))
        self.report(force=True)

    def at(self, position: int) -> None:
        with self.lock:
            if position > self.current:
                self.transferred += position - self.current
            self.current = position
        self.report()

    def end_file(self, size: int) -> None:
        self.finished += size
        self.current = self.resumed = 0
        self.report(force=True)

    def report(self, force: bool = False) -> None:
        update = DownloadProgress("downloading", self.done, self.total, self.rate, self.file)
        if self.progress is not None:
            self.progress(update)
        now = time.monotonic()
        if force or now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            pct = f" ({self.done / self.total:.0%})" if self.total else ""
            log.info(
                "downloading %s: %s / %s%s at %s/s",
                self.ref,
                format_bytes(self.done),
                format_bytes(self.total),
                pct,
                format_bytes(int(self.rate)),
            )


class _MeteredFile:
    """The partial file as huggingface_hub's ``http_get`` writes it: every write is flushed (an interrupted run
    keeps what it received) and counted."""

    def __init__(self, f: BinaryIO, meter: _Meter):
        self.f, self.meter = f, meter

    def write(self, chunk: bytes) -> int:
        n = self.f.write(chunk)
        self.f.flush()
        self.meter.at(self.f.tell())
        return n

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, *args: int) -> int:
        return self.f.seek(*args)

    def truncate(self, *args: int) -> int:  # the server ignored our range: http_get starts the file over
        n = self.f.truncate(*args)
        self.meter.current = self.meter.resumed = self.f.tell()
        return n


def _fetch(dl: HubDownload, name: str, meter: _Meter) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    ref, commit = dl.revision.ref, dl.revision.commit
    storage = _storage_folder(ref.repo_id)
    if (storage / "snapshots" / commit / name).exists():
        meter.end_file(dl.files[name])
        return
    meta = hub_call(
        ref, f"reading {name}", lambda: get_hf_file_metadata(hf_hub_url(ref.repo_id, name, revision=commit))
    )
    if not meta.etag:
        raise HubError(f"{ref}: the Hub gave no ETag for {name}, so it cannot be cached; retry later")
    blob = storage / "blobs" / meta.etag
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
        with open(partial, "ab") as f:
            on_disk = f.tell()
            if meta.size is not None and on_disk > meta.size:  # not a prefix of this file: start over
                f.truncate(0)
                on_disk = 0
            meter.start_file(name, on_disk)
            hub_call(
                ref,
                f"downloading {name}",
                lambda: http_get(
                    meta.location,
                    _MeteredFile(f, meter),
                    resume_size=on_disk,
                    headers=build_hf_headers(),
                    expected_size=meta.size,
                    displayed_filename=name,
                ),
            )
        os.replace(partial, blob)
    # the blob is there: hf_hub_download only links it into snapshots/<commit>/ (the standard cache layout)
    hub_call(ref, f"caching {name}", lambda: hf_hub_download(ref.repo_id, name, revision=commit))
    meter.end_file(meta.size if meta.size is not None else dl.files[name])


def download(dl: HubDownload, progress: Callable[[DownloadProgress], None] | None = None) -> HubSnapshot:
    """Fetch what :func:`prepare_download` listed into the Hub cache (resuming partial files); return the snapshot."""
    rev = dl.revision
    if rev.cached_snapshot is not None:
        log.info("%s: using the cached snapshot %s", rev.ref, rev.cached_snapshot)
        return HubSnapshot(rev.cached_snapshot, rev.ref, rev.commit)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    meter = _Meter(rev.ref, sum(dl.files.values()), progress)
    with disable_progress_bars("huggingface_hub.http_get"):  # our meter reports progress, once, on the log
        # small files first: a bad config or tokenizer shows before gigabytes move
        for name in sorted(dl.files, key=lambda n: (n.endswith(".safetensors"), n)):
            _fetch(dl, name, meter)
    ref = rev.ref
    # record the user's revision (branch or tag) -> commit in refs/, so an offline start finds this snapshot
    path = Path(
        hub_call(ref, "caching config.json", lambda: hf_hub_download(ref.repo_id, CONFIG_NAME, revision=ref.revision))
    )
    if path.parent.name != rev.commit:
        raise HubError(
            f"{ref} moved to commit {path.parent.name} while commit {rev.commit} was downloading; run "
            f"again, or pin the commit with {ref.repo_id}@{rev.commit}"
        )
    log.info(
        "%s: %s in the cache at %s (%s/s)", ref, format_bytes(meter.done), path.parent, format_bytes(int(meter.rate))
    )
    return HubSnapshot(path.parent, ref, rev.commit)


def resolve_model_path(
    model: str | os.PathLike, progress: Callable[[DownloadProgress], None] | None = None
) -> tuple[Path, str | None]:
    """A local model folder for ``model`` (a path, or a Hub id fetched into the cache) and its Hub commit if any."""
    ref = parse_model_ref(model)
    if isinstance(ref, HubRef):
        snap = download(prepare_download(ref), progress)
        return snap.path, snap.commit
    path = Path(model).expanduser()
    snapshot = cached_snapshot_of(path) if path.is_dir() else None
    return path, snapshot.revision if snapshot else None


__all__ = [
    "DownloadProgress",
    "HubDownload",
    "HubSnapshot",
    "SERVE_PATTERNS",
    "wanted",
    "check_disk",
    "prepare_download",
    "download",
    "resolve_model_path",
]
