"""``loadmaster serve MODEL --pipeline`` under ``torchrun``: one stage per rank, the HTTP server on rank 0.

Every rank runs the same command line (``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``). Each
checks that it was started like rank 0 (:func:`agree_on_plan`: a rank started with other planning flags, a different
checkpoint or version is refused on every rank with one line naming each difference), takes the plan rank 0 made
from the serve flags (one host per rank, each planned with the same flags), broadcast, and loads only its stage.

- Rank 0 runs the ordinary server (``service.cli.main.serve`` with :class:`Rank0`'s loader), whose model is a
  :class:`~service.pipeline.stage_model.PipelineModel`: the engine, every route, ``/health/ready``, ``/info`` (with a
  ``pipeline`` section per stage) and ``/metrics`` (``loadmaster_pipeline_stage_*``) work as in one process.
- Ranks 1..k-1 run :func:`~service.pipeline.stage_loop.serve_stage` until rank 0 stops them.

When the ring breaks (a rank died, or stayed silent past ``--pipeline-timeout``), rank 0 sends every open request
an error naming the rank, readiness turns 503 with that message, and after :data:`BROKEN_LINGER_S` the process exits
with status 1 (at the latest :data:`BROKEN_EXIT_S` after the break), so a supervisor restarts the whole group.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from planner.cluster import ClusterPlan
from service.settings import ServiceSettings

log = logging.getLogger("loadmaster.pipeline")

#: Seconds a broken pipeline's server keeps answering (readiness 503, the error to open requests) before it exits.
BROKEN_LINGER_S = 3.0
#: Seconds after a break by which rank 0 has exited whatever else is still running.
BROKEN_EXIT_S = 20.0


def plan_for_settings(settings: ServiceSettings, path: Path, world: int) -> ClusterPlan:
    """The cluster plan every rank makes from the same serve flags: ``world`` hosts, each planned with them."""
    from planner.cluster import plan_cluster
    from planner.hardware.units import parse_rate
    from service.model.positions import model_position_limit, served_context

    inputs = settings.plan_inputs()
    context = served_context(settings, model_position_limit(path))  # as a one-process server plans
    return plan_cluster(
        str(path),
        [inputs] * world,
        dtype=inputs.dtype,
        quantization=inputs.quantization,
        batch_size=inputs.batch_size,
        context=context,
        strategy=inputs.strategy,  # a custom map is refused by the cluster planner with its message
        micro_batches=settings.micro_batches,
        inter_host_bandwidth=parse_rate(settings.inter_host_bandwidth),
        cpu_quantization=inputs.cpu_quantization,
    )


#: Settings every rank must share: they decide the plan (and so each rank's stage) or the serving shape.
AGREED_SETTINGS = (
    "max_memory",
    "gpus",
    "strategy",
    "complete",
    "dtype",
    "quantization",
    "batch_size",
    "context",
    "gpu_reserve",
    "bandwidth",
    "max_batch_size",
    "max_total_tokens",
    "micro_batches",
    "inter_host_bandwidth",
    "cpu_quantization",
)


def serve_identity(settings: ServiceSettings, path: Path, world: int) -> dict[str, str]:
    """What must agree across ranks, by name: version, model, checkpoint fingerprint, ranks and the planning flags."""
    import json

    from loaders.checkpoint.index import CheckpointIndex
    from planner.model.fingerprint import checkpoint_fingerprint
    from service.pipeline.wire import loadmaster_version

    ident = {
        "version": loadmaster_version(),
        "model": path.name,
        "fingerprint": checkpoint_fingerprint(CheckpointIndex.open(path).headers),
        "world size": str(world),
    }
    for name in AGREED_SETTINGS:
        ident[name] = json.dumps(getattr(settings, name), sort_keys=True)
    return ident


def agree_on_plan(settings: ServiceSettings, path: Path, world: int) -> ClusterPlan:
    """Every rank checks it was started like rank 0 (one line naming each differing field, on every rank); then
    rank 0 plans and its plan is broadcast. Planning once keeps ranks that detect their memory at slightly different
    moments (or on different hosts) on one plan: without ``--max-memory``/``--gpus`` every host is planned with
    rank 0's detected hardware."""
    import torch.distributed as dist

    from planner.errors import LoadmasterError, PlanError
    from service.pipeline.wire import check_same_identity, share_plan

    check_same_identity(serve_identity(settings, path, world))
    if dist.get_rank() != 0:
        return share_plan(None)
    try:
        plan = plan_for_settings(settings, path, world)
    except (LoadmasterError, ValueError) as exc:
        try:
            share_plan(None, error=" ".join(str(exc).split()))
        except PlanError:
            pass
        raise
    return share_plan(plan)


def check_pipeline_settings(settings: ServiceSettings) -> int:
    """Refuse what a pipeline cannot serve before any rank waits on another; the world size."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "--pipeline runs one rank per host under torchrun (RANK and WORLD_SIZE are not set): "
            "torchrun --nnodes N --nproc-per-node 1 ... -m service.cli.main serve MODEL --pipeline (see docs/pipeline.md)"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise ValueError(
            "--pipeline needs at least 2 ranks (torchrun --nproc-per-node/--nnodes); serve one host without it"
        )
    from planner.hardware.units import parse_rate
    from service.model.background_load import hub_ref

    parse_rate(settings.inter_host_bandwidth)  # a bad rate stops every rank now, with its message
    if settings.demo:
        raise ValueError("--demo serves one process; for a pipeline give the model directory (the same on every host)")
    if hub_ref(settings) is not None:
        raise ValueError("--pipeline serves a local model directory (the same path on every host), not a Hub id")
    return world


def load_settings_stage(
    settings: ServiceSettings, path: Path, plan: ClusterPlan, index: int, progress: Callable[[Any], None] | None = None
) -> Any:
    """This rank's stage: the one load restricted to it (:func:`loaders.load.load_stage`), with the serve flags
    that decide how a host holds its layers, as one process would load its plan."""
    from loaders.load import load_stage
    from service.model.background_load import load_flags

    return load_stage(path, plan, index, progress=progress, **load_flags(settings))


def join_group(settings: ServiceSettings) -> tuple[int, int]:
    """Check what can be checked alone, then join the torch.distributed group; this rank and the world size."""
    import torch
    import torch.distributed as dist

    from service.model.background_load import check_model_source

    world = check_pipeline_settings(settings)
    check_model_source(settings)
    settings.check_plan_flags()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # this rank's GPU: where NCCL's tensors (and the wire of its Link) live
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=settings.pipeline_timeout))
    return dist.get_rank(), world


def serve_stage_rank(settings: ServiceSettings, rank: int, world: int) -> int:
    """Ranks 1..k-1: plan, check against rank 0, load this stage, serve it until rank 0 says stop."""
    import torch.distributed as dist

    from planner.errors import LoadmasterError
    from service.model.background_load import resolve_model_dir
    from service.pipeline.stage_loop import serve_stage
    from service.pipeline.wire import PipelineBrokenError, PipelineMismatchError

    try:
        path = resolve_model_dir(settings)
        plan = agree_on_plan(settings, path, world)
        stage = load_settings_stage(settings, path, plan, rank)
        log.info("rank %d serves stage %d (layers %d-%d)", rank, rank, stage.stage.first_layer, stage.stage.last_layer)
        serve_stage(stage)
    except (PipelineBrokenError, PipelineMismatchError, LoadmasterError, ValueError, OSError) as exc:
        sys.stderr.write(f"loadmaster: error (pipeline rank {rank}): {' '.join(str(exc).split())}\n")
        sys.stderr.flush()
        os._exit(1)  # the group is broken: leave without waiting on collectives that will never complete
    dist.destroy_process_group()
    return 0


class Rank0:
    """Rank 0's part around the ordinary server: its ``load`` (plan, check, load stage 0, wrap it for the engine),
    ``prepare`` (the per-stage metrics) and ``finish`` (stop the other ranks, or leave at once if broken)."""

    def __init__(self, world: int):
        self.world = world
        self.app: Any = None
        self.model: Any = None

    def prepare(self, app: Any) -> None:
        self.app = app
        app.state.runtime.metrics.registry.register(PipelineCollector(lambda: self.model))

    def load(self, settings: ServiceSettings, progress: Callable[[Any], None]) -> Any:
        import time
        from dataclasses import replace

        from loaders import load_tokenizer
        from service.model.background_load import LoadedModel, LoadPhase, resolve_model_dir
        from service.pipeline.stage_model import PipelineModel

        t0 = time.perf_counter()
        path = resolve_model_dir(settings)
        tokenizer = load_tokenizer(path)
        progress(LoadPhase(phase="planning"))
        plan = agree_on_plan(settings, path, self.world)
        stage = load_settings_stage(settings, path, plan, 0, progress)
        model = PipelineModel(stage, plan, plan.micro_batches, heartbeat_s=min(2.0, settings.pipeline_timeout / 3))
        model.on_broken(lambda message: _on_broken(self.app, message))
        self.model = model
        model.start_heartbeat()
        # /info's load_stats: stage 0's load (placement, quantization, native kernels), timed from the plan
        stats = replace(stage.stats, seconds=time.perf_counter() - t0, bytes_read=stage.bytes_read)
        model.load_stats = stats
        return LoadedModel(
            model=model,
            tokenizer=tokenizer,
            path=path,
            name=(settings.served_names() or [path.name])[0],
            plan=plan.stages[0].plan,
            dtype=plan.workload.dtype,
            quantization=plan.workload.quantization,
            load_stats=stats,
        )

    def finish(self, code: int) -> int:
        """After the server stopped: a clean stop tells every stage to end; a broken group leaves at once."""
        import torch.distributed as dist

        if self.model is None or self.model.broken is not None or code != 0:
            logging.shutdown()
            sys.stderr.flush()
            os._exit(code or 1)  # no clean goodbye is possible, and a supervisor must restart every rank
        self.model.stop()
        dist.destroy_process_group()
        return code


def _on_broken(app: Any, message: str) -> None:
    """The ring broke: readiness 503 with the reason, the error to every open request, then exit 1."""
    from service.engine.requests import ErrorEvent
    from service.errors import NotReadyError
    from service.log_text import public_message

    watchdog = threading.Timer(BROKEN_EXIT_S, os._exit, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    if app is None:
        return
    runtime = app.state.runtime
    # the log has the whole reason (PipelineStageModel._break); clients get it without source paths and peer addresses
    text = f"The model pipeline broke ({public_message(message)}); the server is restarting. Retry the request shortly."
    state = runtime.host.state
    state.error, state.error_type, state.phase = text, NotReadyError.error_type, "failed"
    with runtime._streams_lock:  # noqa: SLF001 - the runtime's open streams, as its grace period reads them
        streams = list(runtime.streams)
    error = ErrorEvent.of(NotReadyError(text))
    for stream in streams:
        stream.deliver(error)
    if runtime.engine is not None:
        threading.Thread(target=runtime.engine.stop, name="loadmaster-pipeline-stop", daemon=True).start()
    # the server's failed-load path stops uvicorn and makes serve() return 1; after the linger, so that readiness
    # and the open requests' errors are seen first
    stop = threading.Timer(BROKEN_LINGER_S, runtime.host._failed, args=(text, NotReadyError.error_type))  # noqa: SLF001
    stop.daemon = True
    stop.start()


class PipelineCollector:
    """``loadmaster_pipeline_stage_*`` gauges per stage, read from rank 0's model at scrape time."""

    def __init__(self, model: Callable[[], Any]):
        self.model = model

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        busy = GaugeMetricFamily(
            "loadmaster_pipeline_stage_busy_fraction",
            "Share of its serving time each pipeline stage spent computing.",
            labels=["stage"],
        )
        layers = GaugeMetricFamily(
            "loadmaster_pipeline_stage_layers", "Decoder layers of each stage.", labels=["stage"]
        )
        memory = GaugeMetricFamily(
            "loadmaster_pipeline_stage_memory_bytes",
            "Memory of each pipeline stage: planned (weights, kv_cache) and measured (resident weights, KV cache).",
            labels=["stage", "kind", "what"],
        )
        model = self.model()
        if model is not None:
            for st in model.pipeline_report()["stages"]:
                label = str(st["stage"])
                busy.add_metric([label], st["busy_fraction"])
                layers.add_metric([label], st["num_layers"])
                for kind in ("planned", "measured"):
                    for what in ("weights", "kv_cache"):
                        memory.add_metric([label, kind, what], st["memory"][kind][what])
        yield busy
        yield layers
        yield memory
