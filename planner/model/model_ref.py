"""Model references: a local path, or a Hugging Face Hub id ``org/name[@revision]``, and what the Hub says about it.

Every place that takes a model (``loadmaster plan``/``estimate``/``serve``, ``/plan``, ``loaders.load_model``)
hands its string to :func:`parse_model_ref`. An existing path always wins; a string shaped like ``org/name`` (or
written ``hf://org/name`` to insist on the Hub) that is no path is a :class:`HubRef`. A name that is both a local
directory and a repository already in the Hub cache is reported as ambiguous (the local directory is used).

Planning by id needs two small things from the Hub, never the weights: ``config.json`` and the safetensors header of
each shard (huggingface_hub's ``get_safetensors_metadata``: HTTP range requests of ~100 kB per shard). Both are
fetched at the exact commit the revision resolves to, and the Skeleton (hence the Plan) records that commit so the
loader can check it is loading what was planned.

huggingface_hub is imported lazily (it reads ``HF_ENDPOINT``, ``HF_HOME``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` when
imported, and the planner core must stay cheap to import); it is the only client of the Hub here.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from planner.errors import ModelSourceError
from planner.model.safetensors_header import (
    INDEX_NAME,
    PICKLE_SUFFIXES,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    CheckpointHeaders,
    HeaderTensor,
    SafetensorsHeader,
)

log = logging.getLogger(__name__)

HUB_PREFIX = "hf://"
#: The Hub's own rule for repository ids: one namespace, one name, from [A-Za-z0-9._-], no leading '-' or '.'.
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID_RE = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^\s@]+))?$")
CONFIG_NAME = "config.json"

T = TypeVar("T")


class HubError(ModelSourceError):
    """The Hub cannot give us the model: gated, missing, unreachable without a cache, pickled-only, no disk."""

    error_type = "hub"


@dataclass(frozen=True)
class HubRef:
    """``org/name`` at ``revision`` (a branch, tag or commit; ``None`` means the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubRevision:
    """What the Hub (or the cache, offline) says a reference is: the commit and the files there with their sizes."""

    ref: HubRef
    commit: str
    #: file name -> size in bytes (None when the listing gave no size)
    files: dict[str, int | None]
    #: the cached snapshot folder when the answer came from the cache (offline or unreachable Hub)
    cached_snapshot: Path | None = None

    @property
    def safetensors(self) -> list[str]:
        return sorted(f for f in self.files if f.endswith(".safetensors"))

    @property
    def pickled(self) -> list[str]:
        return sorted(f for f in self.files if f.endswith(PICKLE_SUFFIXES))


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID_RE.match(text.removeprefix(HUB_PREFIX)))


def parse_model_ref(text: str | os.PathLike) -> Path | HubRef | None:
    """The local path ``text`` names, else the Hub reference it spells, else ``None`` (neither).

    ``hf://org/name[@rev]`` always means the Hub; ``./org/name`` or an absolute path always means a path.
    """
    raw = os.fspath(text)
    if raw.startswith(HUB_PREFIX):
        m = _HUB_ID_RE.match(raw[len(HUB_PREFIX) :])
        if not m:
            raise ModelSourceError(f"{raw!r} is not a Hub reference: write hf://org/name or hf://org/name@revision")
        return HubRef(m["repo"], m["rev"])
    path = Path(raw).expanduser()
    m = _HUB_ID_RE.match(raw)
    if path.exists():
        if m and _in_hub_cache(m["repo"]):
            log.warning(
                "%r is ambiguous: it is a local path and a Hub repository in the cache; using the local "
                "path %s (write hf://%s for the Hub one)",
                raw,
                path.resolve(),
                raw,
            )
        return path
    if m:
        return HubRef(m["repo"], m["rev"])
    return None


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")).is_dir()


_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def cached_snapshot_of(path: str | os.PathLike) -> HubRef | None:
    """``org/name@<commit>`` when ``path`` is a Hub cache snapshot folder (``models--org--name/snapshots/<commit>``),
    so a plan made from the cache names the repository and the commit it was made for."""
    p = Path(path).resolve()
    repo_dir = p.parent.parent
    if p.parent.name != "snapshots" or not _COMMIT_RE.match(p.name) or not repo_dir.name.startswith("models--"):
        return None
    parts = repo_dir.name.removeprefix("models--").split("--")
    return HubRef("/".join(parts), p.name) if len(parts) == 2 else None


def hub_call(ref: HubRef, what: str, fn: Callable[[], T]) -> T:
    """Run one huggingface_hub call and turn its failures into one-line :class:`HubError` messages."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    try:
        return fn()
    except hf.GatedRepoError as e:
        status = e.response.status_code if e.response is not None else 401
        from huggingface_hub import get_token

        if status == 401 or not get_token():
            raise HubError(
                f"{ref.repo_id} is gated: {what} needs a token; accept its terms on the Hub, then set "
                "HF_TOKEN (or run `hf auth login`)"
            ) from None
        raise HubError(
            f"{ref.repo_id} is gated and the token in use has no access to it (403); accept its terms "
            "on the Hub with that account, or use a token that has access"
        ) from None
    except hf.RevisionNotFoundError:
        raise HubError(
            f"{ref.repo_id} has no revision {ref.revision or 'main'!r} (404); check the branch, tag or commit after '@'"
        ) from None
    except hf.RepositoryNotFoundError:
        raise HubError(
            f"{ref.repo_id}: no such local path, and no such repository on {constants.ENDPOINT} (404) "
            "or it is private and no valid HF_TOKEN is set; check the name, or set HF_TOKEN"
        ) from None
    except hf.RemoteEntryNotFoundError as e:
        raise HubError(
            f"{ref}: {what}: file not found in the repository ({e.response.url if e.response else ''})"
        ) from None
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status == 403:
            raise HubError(
                f"{ref.repo_id}: access refused (403) while {what}; use a token with read access (HF_TOKEN)"
            ) from None
        raise HubError(f"{ref}: the Hub answered {status} while {what}; retry later") from None
    except hf.OfflineModeIsEnabled:
        raise HubError(
            f"{ref}: HF_HUB_OFFLINE is set and {what} needs the Hub: download the model once with "
            "network, or unset HF_HUB_OFFLINE"
        ) from None
    except hf.LocalEntryNotFoundError:  # the Hub went away between two calls, and the file is not cached
        raise HubError(
            f"{ref}: the Hub at {constants.ENDPOINT} cannot be reached while {what}, and the file is not "
            "in the Hub cache; check the network (or HF_ENDPOINT) and run again"
        ) from None
    except Exception as e:  # noqa: BLE001 - httpx's network errors; anything else is re-raised as it is
        if not _is_network_error(e):
            raise
        raise HubError(
            f"{ref}: the Hub at {constants.ENDPOINT} cannot be reached while {what} "
            f"({type(e).__name__}); check the network (or HF_ENDPOINT) and run again"
        ) from None


def _is_network_error(exc: BaseException) -> bool:
    """A connection that failed (refused, no route, DNS, timeout), whichever httpx huggingface_hub is built on."""
    import importlib

    classes: list[type] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):  # huggingface_hub 2.x uses httpx2, 1.x httpx
        try:
            classes.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return isinstance(exc, tuple(classes))


def _reraise(exc: BaseException) -> Any:
    raise exc


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached_revision(ref: HubRef, why: str) -> HubRevision:
    """The cached snapshot of ``ref`` (for offline use), or a :class:`HubError` saying there is none."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise HubError(
            f"{ref}: no such local path; {why}, and it is not in the Hub cache "
            f"({constants.HF_HUB_CACHE}); connect to the "
            "network (or set HF_ENDPOINT) and run again, or set HF_HOME to a cache that holds it"
        ) from None
    files = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    return HubRevision(ref, folder.name, files, cached_snapshot=folder)


def resolve_revision(ref: HubRef, *, what: str = "resolving the revision") -> HubRevision:
    """Ask the Hub which commit ``ref`` is and which files it holds; offline or unreachable, ask the cache."""
    if _offline():
        return cached_revision(ref, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi, constants

    try:
        info = HfApi().model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - network errors come from httpx, whose classes we test below
        if not _is_network_error(e):
            return hub_call(ref, what, lambda exc=e: _reraise(exc))
        log.warning("the Hub at %s cannot be reached (%s); looking in the cache", constants.ENDPOINT, e)
        return cached_revision(ref, f"the Hub at {constants.ENDPOINT} cannot be reached ({type(e).__name__})")
    if not info.sha:
        raise HubError(f"{ref}: the Hub named no commit for this revision; retry, or give a commit after '@'")
    files = {s.rfilename: s.size for s in (info.siblings or [])}
    return HubRevision(ref, info.sha, files)


def refuse_pickled_only(rev: HubRevision) -> None:
    """loadmaster only reads safetensors: a repository without them is refused, naming the pickled files."""
    if rev.safetensors:
        return
    if rev.pickled:
        raise HubError(
            f"{rev.ref} has only pickled weights ({', '.join(rev.pickled[:5])}), which loadmaster never loads "
            "because unpickling can run arbitrary code; use a revision with safetensors (the Hub's conversion bot "
            f"opens them as pull requests: {rev.ref.repo_id}@refs/pr/N), or convert them and upload the result"
        )
    raise HubError(
        f"{rev.ref} has no safetensors weights ({INDEX_NAME} or *.safetensors); it cannot be planned "
        "or served from its weights. Plan its config.json alone by passing a local copy of it"
    )


def _remote_headers(rev: HubRevision) -> CheckpointHeaders:
    """Every shard's safetensors header at ``rev.commit``, by HTTP range requests (no weight data)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import disable_progress_bars

    ref = rev.ref
    with disable_progress_bars():  # a per-shard bar on stderr says nothing the plan's log line does not
        meta = hub_call(
            ref,
            "reading the safetensors headers",
            lambda: HfApi().get_safetensors_metadata(ref.repo_id, revision=rev.commit),
        )
    base = f"{HUB_PREFIX}{ref.repo_id}@{rev.commit}"
    files: list[SafetensorsHeader] = []
    tensors: dict[str, HeaderTensor] = {}
    metadata: dict[str, str] = {}
    for fname in dict.fromkeys(meta.weight_map.values()):
        fmeta = meta.files_metadata[fname]
        ends = [int(t.data_offsets[1]) for t in fmeta.tensors.values()] or [0]
        size = rev.files.get(fname)
        # the data region ends the file, so its start is the file size minus the region's length
        data_start = (int(size) - max(ends)) if size is not None else 0
        entries: dict[str, HeaderTensor] = {}
        for name, info in fmeta.tensors.items():
            dtype = SAFETENSORS_DTYPES.get(info.dtype)
            if dtype is None:
                raise HubError(
                    f"{base}/{fname}: tensor {name!r} has dtype {info.dtype}, which loadmaster does not know"
                )
            begin, end = (int(x) for x in info.data_offsets)
            entries[name] = HeaderTensor(
                name, dtype, tuple(int(d) for d in info.shape), data_start + begin, end - begin, fname
            )
        files.append(
            SafetensorsHeader(
                Path(fname),
                entries,
                dict(fmeta.metadata or {}),
                data_start,
                int(size) if size is not None else data_start + max(ends),
            )
        )
        metadata.update(fmeta.metadata or {})
        tensors.update(entries)
    weight_map = {str(k): str(v) for k, v in meta.weight_map.items()}
    return CheckpointHeaders(Path(base), tuple(files), tensors, weight_map, metadata)


def _remote_config(rev: HubRevision) -> dict[str, Any] | None:
    from huggingface_hub import hf_hub_download

    if CONFIG_NAME not in rev.files:
        return None
    ref = rev.ref
    path = hub_call(
        ref, "downloading config.json", lambda: hf_hub_download(ref.repo_id, CONFIG_NAME, revision=rev.commit)
    )
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HubError(f"{ref}: config.json is not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise HubError(f"{ref}: config.json is not a JSON object")
    return doc


@dataclass(frozen=True)
class HubCheckpoint:
    """What planning a Hub model needs, read at one commit: its config and shard headers, or (offline) the cached
    snapshot folder that holds them."""

    ref: HubRef
    commit: str
    source: str  # hf://org/name@commit, for messages
    config: dict[str, Any] | None = None
    headers: CheckpointHeaders | None = None
    snapshot: Path | None = None


def read_hub_checkpoint(ref: HubRef) -> HubCheckpoint:
    """config.json and every shard header of ``ref`` (never the weights); offline, the cached snapshot instead."""
    rev = resolve_revision(ref)
    source = f"{HUB_PREFIX}{ref.repo_id}@{rev.commit}"
    if rev.cached_snapshot is not None:
        return HubCheckpoint(ref, rev.commit, source, snapshot=rev.cached_snapshot)
    refuse_pickled_only(rev)
    if not (INDEX_NAME in rev.files or SINGLE_NAME in rev.files):
        raise HubError(
            f"{ref} has safetensors files but neither {SINGLE_NAME} nor {INDEX_NAME}; loadmaster needs "
            "one of them to know the shards"
        )
    doc = _remote_config(rev)
    headers = _remote_headers(rev)
    log.info("read %s: config.json and %d shard header(s) at commit %s", ref, len(headers.files), rev.commit)
    return HubCheckpoint(ref, rev.commit, source, config=doc, headers=headers)


__all__ = [
    "HubRef",
    "HubRevision",
    "HubError",
    "parse_model_ref",
    "cached_snapshot_of",
    "looks_like_hub_id",
    "resolve_revision",
    "cached_revision",
    "refuse_pickled_only",
    "HubCheckpoint",
    "read_hub_checkpoint",
    "hub_call",
]
