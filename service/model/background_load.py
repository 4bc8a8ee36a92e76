"""Loading the served model in the background, and the load's progress for ``/health/ready`` and ``/info``.

The server listens at once; :class:`ModelHost` loads on a thread (the checkpoint is described once, planned from
its Skeleton, then the loader fills that same meta model as the plan says) and
records progress from the loader's callback. Routes read :class:`LoadState` and answer 503 until it is ready.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.api import plan_inputs
from planner.errors import LoadmasterError
from planner.types import Plan
from service.model.model_paths import confine_model_files, real_roots
from service.model.positions import model_position_limit
from service.settings import ServiceSettings

if TYPE_CHECKING:  # the loader (torch, transformers) is imported on the loading thread, not with the service
    from loaders.checkpoint.load_progress import LoadStats

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """What the engine needs, and what ``/info`` reports about it."""

    model: Any
    tokenizer: Any
    path: Path
    name: str
    plan: Plan | None
    dtype: str
    quantization: str | None
    #: What the load placed where, typed: ``/info`` and ``/metrics`` read memory per device from it.
    load_stats: LoadStats


@dataclass(frozen=True)
class LoadPhase:
    """A progress update of the service's own steps (the loader sends ``loaders.LoadProgress``)."""

    phase: str
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass
class LoadState:
    """Progress of the background load. Written by the loading thread, read by the routes."""

    #: starting | building demo model | planning | the loader's phases (validating, building, loading, offloading,
    #: dispatching) | warming | ready | failed
    phase: str = "starting"
    bytes_done: int = 0
    bytes_total: int = 0
    #: bytes per second while downloading from the Hub (None in other phases)
    rate: float | None = None
    error: str | None = None
    error_type: str | None = None
    started_at: float = field(default_factory=time.time)
    ready_at: float | None = None

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def to_dict(self) -> dict[str, Any]:
        fraction = self.bytes_done / self.bytes_total if self.bytes_total else (1.0 if self.ready else 0.0)
        out: dict[str, Any] = {
            "status": self.phase,
            "progress": round(min(fraction, 1.0), 4),
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "elapsed_s": round((self.ready_at or time.time()) - self.started_at, 3),
        }
        if self.rate is not None:
            out["rate_bytes_per_s"] = round(self.rate)
        if self.error:
            out["error"] = self.error
            out["error_type"] = self.error_type
        return out


def check_model_source(settings: ServiceSettings) -> None:
    """Refuse a model that cannot be served before the server starts: a missing directory, or a Hub id that is
    gated, missing, pickled-only, unreachable without a cache, or too big for the disk (nothing downloaded yet)."""
    hub = hub_ref(settings)
    if hub is not None:
        from loaders.checkpoint.hub_download import prepare_download

        prepare_download(hub)
    elif not settings.demo:
        resolve_model_dir(settings)


def hub_ref(settings: ServiceSettings) -> Any:
    """The Hub reference ``MODEL`` spells when it is no local path (see :mod:`planner.model.model_ref`), else None."""
    if settings.demo or not settings.model:
        return None
    from planner.model.model_ref import HubRef, parse_model_ref

    ref = parse_model_ref(settings.model)
    return ref if isinstance(ref, HubRef) else None


def resolve_model_dir(settings: ServiceSettings) -> Path:
    """The directory to serve: ``--demo`` builds (or reuses) the demo model, otherwise ``MODEL``."""
    if settings.demo:
        from service.model.demo_model import build_demo_model

        return Path(build_demo_model())
    if not settings.model:
        raise ValueError(
            "No model to serve: pass a model directory (loadmaster serve DIR), a Hub id "
            "(loadmaster serve org/name), or --demo."
        )
    path = Path(settings.model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"Model directory {str(path)!r} does not exist; pass a directory with config.json and *.safetensors."
        )
    confine_model_files(path, serve_roots(settings, path), ALLOWED_ROOT_OPTION)
    refuse_lengths_beyond_positions(settings, path)
    return path.resolve()


def refuse_lengths_beyond_positions(settings: ServiceSettings, path: Path) -> None:
    """An explicit ``--max-total-tokens`` (flag or environment) beyond the model's positions is refused, not
    lowered: the user asked for sequences the model cannot hold. The default (2048) is still capped quietly at
    load, since nobody asked for it."""
    positions = model_position_limit(path)
    if positions and "max_total_tokens" in settings.model_fields_set and settings.max_total_tokens > positions:
        raise ValueError(
            f"--max-total-tokens {settings.max_total_tokens} is more than the {positions} positions the model "
            f"holds (max_position_embeddings in {path.name}/config.json); give at most {positions}, and "
            f"--max-input-tokens below it."
        )


#: How the setting that widens the served model's roots is spelled in refusals.
ALLOWED_ROOT_OPTION = "--allowed-root (LOADMASTER_ALLOWED_ROOT)"


def serve_roots(settings: ServiceSettings, model_dir: Path) -> list[Path]:
    """Where the served model's files may resolve into: the ``--allowed-root`` directories, else the model's own
    directory; for a Hub cache snapshot, its repository's cache folder (the snapshot's files link into ``blobs``)."""
    if settings.allowed_root:
        return real_roots(settings.allowed_root)
    real = model_dir.resolve()
    return [real.parent.parent] if real.parent.name == "snapshots" else [real]


def load_model(settings: ServiceSettings, progress: Callable[[Any], None]) -> LoadedModel:
    """Describe the checkpoint once, plan from its Skeleton, then load into the very meta model the Skeleton was
    walked from. Runs on the loading thread."""
    from loaders import load_checkpoint, load_tokenizer
    from planner.model.skeleton import describe_checkpoint
    from planner.placement.sizing import normalize_dtype

    if settings.demo:
        progress(LoadPhase(phase="building demo model"))
    hub = hub_ref(settings)
    commit: str | None = None
    if hub is not None:  # fetch into the Hub cache (progress: phase "downloading")
        from loaders.checkpoint.hub_download import download, prepare_download

        snapshot = download(prepare_download(hub), progress)
        path, commit = snapshot.path, snapshot.commit
        confine_model_files(path, serve_roots(settings, path), ALLOWED_ROOT_OPTION)
        refuse_lengths_beyond_positions(settings, path)
    else:
        path = resolve_model_dir(settings)
    inputs = settings.plan_inputs()
    if settings.context is None:  # plan for what the server will allow, which the model's positions cap
        positions = model_position_limit(path)
        if positions and inputs.context is not None:
            inputs = replace(inputs, context=min(inputs.context, positions))
    tokenizer = load_tokenizer(path)  # a directory without one fails before any weight is read
    described = describe_checkpoint(
        path,
        normalize_dtype(inputs.dtype, "float32") if inputs.dtype else None,
        name=hub.repo_id if hub is not None else None,
    )
    if commit is not None:  # the plan names the Hub commit it was made for
        described = replace(described, skeleton=replace(described.skeleton, revision=commit))
    progress(LoadPhase(phase="planning"))
    the_plan = plan_inputs(described.skeleton, inputs)
    result = load_checkpoint(
        described,
        device_map=the_plan,
        offload_folder=settings.offload_folder,
        progress=progress,
        cpu_kernels=settings.cpu_kernels,
        cpu_quantization=settings.cpu_quantization,
        cpu_quantized_dir=settings.cpu_quantized_dir,
    )
    result.model.eval()
    name = settings.served_model_name or (hub.repo_id if hub is not None else path.name)
    return LoadedModel(
        model=result.model,
        tokenizer=tokenizer,
        path=path,
        name=name,
        plan=the_plan,
        dtype=the_plan.workload.dtype,
        quantization=the_plan.workload.quantization,
        load_stats=result.stats,
    )


Loader = Callable[[ServiceSettings, Callable[[Any], None]], LoadedModel]


class ModelHost:
    """Runs the load on a thread and holds its result: the loaded model, or the error that stopped it."""

    def __init__(self, settings: ServiceSettings, loader: Loader = load_model):
        self.settings = settings
        self.loader = loader
        self.state = LoadState()
        self.loaded: LoadedModel | None = None
        self._thread: threading.Thread | None = None
        self._on_ready: list[Callable[[LoadedModel], None]] = []
        self._on_failed: list[Callable[[str], None]] = []

    def on_ready(self, callback: Callable[[LoadedModel], None]) -> None:
        self._on_ready.append(callback)

    def on_failed(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` when the load fails (``loadmaster serve`` then exits non-zero)."""
        self._on_failed.append(callback)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._load, name="loadmaster-load", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _progress(self, update: Any) -> None:
        phase = str(getattr(update, "phase", "") or "loading")
        self.state.phase = "warming" if phase == "ready" else phase  # ready only once the engine runs
        self.state.bytes_done = int(getattr(update, "bytes_done", 0))
        self.state.bytes_total = int(getattr(update, "bytes_total", 0))
        rate = getattr(update, "rate", None)
        self.state.rate = float(rate) if rate is not None else None

    def _load(self) -> None:
        self.state.phase = "planning"
        try:
            loaded = self.loader(self.settings, self._progress)
            self.state.phase = "warming"
            for callback in self._on_ready:
                callback(loaded)
            self.loaded = loaded
            self.state.bytes_done = max(self.state.bytes_done, self.state.bytes_total)
            self.state.ready_at = time.time()
            self.state.phase = "ready"
            log.info("model %s ready in %.1fs", loaded.name, self.state.ready_at - self.state.started_at)
        except (LoadmasterError, ValueError, OSError) as exc:
            self._failed(" ".join(str(exc).split()), getattr(exc, "error_type", "not_ready"))
        except Exception as exc:  # noqa: BLE001 - a failed load must be reported, not kill the server
            log.debug("the load's traceback", exc_info=exc)  # the one error line below is what an operator reads
            self._failed(f"{type(exc).__name__}: {' '.join(str(exc).split())}", "not_ready")

    def stop_serving(self, message: str) -> None:
        """The loaded model can no longer be served (its files changed): failed, and the server exits non-zero."""
        self.state.error, self.state.error_type, self.state.phase = message, "not_ready", "failed"
        for callback in self._on_failed:
            callback(message)

    def _failed(self, message: str, error_type: str) -> None:
        self.state.error = message
        self.state.error_type = error_type
        self.state.phase = "failed"
        log.error("loading the model failed: %s", message)
        for callback in self._on_failed:
            callback(message)
