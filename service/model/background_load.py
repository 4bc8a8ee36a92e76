"""Loading the served model in the background, and the load's progress for ``/health/ready`` and ``/info``.

The server listens at once; :class:`ModelHost` loads on a thread through the one load (:func:`loaders.load_checkpoint`:
the checkpoint is described once, planned from its Skeleton, and that same meta model filled as the plan says) and
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

from planner.errors import LoadmasterError
from planner.placement.inputs import PlanInputs
from planner.placement.served_shape import choose_slots, choose_step
from planner.placement.speculative_rate import draft_tokens, with_draft_tokens
from planner.types import PREFILL_CHUNK, Plan
from service.model.disk_tier import with_checkpoint_disk
from service.model.draft_copy import DRAFT_SCHEMES, DraftCopy
from service.model.draft_model import draft_dir, load_drafting, plan_drafting
from service.model.model_paths import confine_model_files, real_roots
from service.model.positions import model_position_limit, planned_context, served_context
from service.model.storage_rate import with_disk_rate, with_memory_rate
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
    #: The draft model: ``--speculate int4|int8``'s (the same checkpoint quantized, CPU-resident) or
    #: ``--draft-model``'s (else None).
    draft: DraftCopy | None = None


@dataclass(frozen=True)
class LoadPhase:
    """A progress update of the service's own steps (the loader sends ``loaders.LoadProgress``)."""

    phase: str
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass
class LoadState:
    """Progress of the background load. Written by the loading thread, read by the routes."""

    #: starting | building demo model | downloading | the loader's phases (validating, building, planning, loading,
    #: offloading, dispatching) | loading draft copy | loading draft model | warming | ready | failed
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
    gated, missing, pickled-only, unreachable without a cache, or too big for the disk (nothing downloaded yet); and
    a ``--draft-model`` that is missing, no safetensors checkpoint, or outside the allowed roots."""
    hub = hub_ref(settings)
    if hub is not None:
        from loaders.checkpoint.hub_download import prepare_download

        prepare_download(hub)
    elif not settings.demo:
        resolve_model_dir(settings)
    if settings.draft_model is not None:
        draft_dir(settings, ALLOWED_ROOT_OPTION)


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
    """An explicit ``--max-total-tokens`` or ``--context`` (flag or environment) beyond the model's positions is
    refused, not lowered: the user asked for sequences the model cannot hold. The default (2048) is still capped
    quietly at load, since nobody asked for it (and ``/info``, ``/plan`` and the page then report the cap)."""
    positions = model_position_limit(path)
    if settings.context is not None:
        planned_context(settings.context, settings.context, positions, what="--context")
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


def load_flags(settings: ServiceSettings) -> dict[str, Any]:
    """The serve flags that decide how this host holds the weights it is given (offload folder, CPU quantization
    and its saved copies, native kernels), as the loader's keyword arguments: one process and every pipeline rank
    load with the same."""
    return {
        "offload_folder": settings.offload_folder,
        "cpu_kernels": settings.cpu_kernels,
        "cpu_quantization": settings.cpu_quantization,
        "cpu_quantized_dir": settings.cpu_quantized_dir,
    }


def served_inputs(settings: ServiceSettings, path: Path) -> tuple[PlanInputs, list[str]]:
    """What the served model is planned for, and the reasons of what was chosen for it: the box
    (:func:`box_inputs`), then the engine's shape on it (:func:`shaped_inputs`)."""
    inputs, reasons = box_inputs(settings, path)
    return shaped_inputs(settings, path, inputs, reasons)


def box_inputs(settings: ServiceSettings, path: Path) -> tuple[PlanInputs, list[str]]:
    """The box the served model is planned on: the context the model's positions allow, and the disk tier (a folder
    under the cache for what must be cast; the rest is read in place from the shards) where the machine's memory is
    detected, its devices measured once (a draft model is planned on the same)."""
    inputs = settings.plan_inputs()
    inputs = replace(inputs, context=served_context(settings, model_position_limit(path)))
    inputs = with_checkpoint_disk(inputs, path)
    inputs = replace(inputs, resolved_hardware=inputs.hardware())  # measured once: every choice below sees it
    inputs, disk_reason = with_disk_rate(inputs, path)
    if disk_reason is None:
        return inputs, []
    inputs, memory_reason = with_memory_rate(inputs)
    return inputs, [disk_reason] if memory_reason is None else [disk_reason, memory_reason]


def shaped_inputs(
    settings: ServiceSettings, path: Path, inputs: PlanInputs, reasons: list[str]
) -> tuple[PlanInputs, list[str]]:
    """The engine's shape on the box ``inputs`` resolved (beside the draft model they reserve for, if any): its
    prefill step and, unless ``--batch-size`` was given, as many KV slots as fit without slowing a lone stream
    (:mod:`planner.placement.served_shape`; the engine then runs that many sequences at once, each step
    prefilling at most that many prompt tokens)."""
    # the step for the slots the server is told, else for the floor of one sequence (the slots follow the step)
    step = choose_step(path, inputs if settings.batch_size is not None else replace(inputs, batch_size=1))
    inputs = replace(inputs, prefill_chunk=step.prefill_chunk)
    reasons = [*reasons, step.reason]
    if settings.batch_size is None:
        slots = choose_slots(path, inputs, settings.max_batch_size)
        inputs = replace(inputs, batch_size=slots.batch_size)
        reasons.append(slots.reason)
    for reason in reasons:
        log.info("served shape: %s", reason)
    return inputs, reasons


def load_model(settings: ServiceSettings, progress: Callable[[Any], None]) -> LoadedModel:
    """Fetch (from the Hub) and confine the model's folder, read its tokenizer, then hand the plan inputs to the
    one load (:func:`loaders.load_checkpoint`: describe, plan from that Skeleton, place, execute). Runs on the
    loading thread."""
    from loaders import load_checkpoint, load_tokenizer

    if settings.demo:
        progress(LoadPhase(phase="building demo model"))
    hub = hub_ref(settings)
    if hub is not None:  # fetch into the Hub cache (progress: phase "downloading")
        from loaders.checkpoint.hub_download import download, prepare_download

        path = download(prepare_download(hub), progress).path  # a snapshot folder: the plan names its commit
        confine_model_files(path, serve_roots(settings, path), ALLOWED_ROOT_OPTION)
        refuse_lengths_beyond_positions(settings, path)
    else:
        path = resolve_model_dir(settings)
    tokenizer = load_tokenizer(path)  # a directory without one fails before any weight is read
    inputs, box_reasons = box_inputs(settings, path)  # after the tokenizer: the box's footprint holds it
    # the draft first (planned on the same box, its tokenizer checked), so that the target's plan reserves for it
    drafting = plan_drafting(settings, path, tokenizer, inputs, ALLOWED_ROOT_OPTION)
    if drafting is not None:
        inputs = replace(inputs, draft=drafting.budget)
    inputs, shape_reasons = shaped_inputs(settings, path, inputs, box_reasons)
    result = load_checkpoint(path, device_map=inputs, progress=progress, **load_flags(settings))
    result.model.eval()
    the_plan = result.plan
    assert the_plan is not None, "a load from plan inputs carries its plan"
    the_plan.reasons.extend(shape_reasons)
    # the draft was budgeted before the target's plan said whether its weights stream: now the default can follow
    the_plan = with_draft_tokens(the_plan, draft_tokens(settings.speculate_tokens, the_plan))
    draft = None
    if drafting is not None:
        copy = drafting.scheme in DRAFT_SCHEMES
        if copy:
            refuse_draft_beside_gpus(drafting.scheme, result.device_map)
        progress(LoadPhase(phase="loading draft copy" if copy else "loading draft model"))
        draft = load_drafting(drafting, path, the_plan)
    name = settings.served_names()[0] if settings.served_model_name else (hub.repo_id if hub is not None else path.name)
    return LoadedModel(
        model=result.model,
        tokenizer=tokenizer,
        path=path,
        name=name,
        plan=the_plan,
        dtype=the_plan.workload.dtype,
        quantization=the_plan.workload.quantization,
        load_stats=result.stats,
        draft=draft,
    )


def refuse_draft_beside_gpus(scheme: str, device_map: dict[str, Any]) -> None:
    """``--speculate int4|int8`` drafts on the CPU's native quantized kernels; a target with layers on a GPU decodes
    a token faster than that copy drafts one, so drafts would only slow it: refused, with what to use instead."""
    gpus = sorted({str(d) for d in device_map.values() if isinstance(d, int)})
    if gpus:
        raise ValueError(
            f"--speculate {scheme} drafts with a CPU-resident {scheme} copy of the model (native CPU kernels), but "
            f"the plan puts layers on GPU {', '.join(gpus)}, which decodes faster than that copy drafts; serve "
            "with --speculate ngram or off, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to serve from the CPU and disk."
        )


def engine_slots(settings: ServiceSettings, loaded: LoadedModel) -> int:
    """Sequences the engine runs at once: the batch its plan budgeted KV for (never more: the plan would not hold),
    within ``--max-batch-size``."""
    if loaded.plan is None:
        return settings.max_batch_size
    return max(1, min(settings.max_batch_size, loaded.plan.workload.batch_size))


def running_sequences(settings: ServiceSettings, loaded: LoadedModel) -> int:
    """Sequences the engine may decode at once: ``--max-batch-size``, though its KV pool holds only
    :func:`engine_slots` sequences of the full context (the scheduler seats more while they are shorter). A
    pipeline keeps the plan's slots: its ranks set up caches of one shape."""
    return engine_slots(settings, loaded) if settings.pipeline else settings.max_batch_size


def engine_prefill_chunk(loaded: LoadedModel) -> int:
    """The most prompt tokens one engine step prefills: the step its plan budgeted activations for."""
    chunk = loaded.plan.workload.prefill_chunk if loaded.plan is not None else None
    return chunk or PREFILL_CHUNK


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
