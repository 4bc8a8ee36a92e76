"""The engine's runner for a model whose decoder layers span several GPUs of this host, in one process.

accelerate runs such a device map one GPU at a time: while GPU 1 computes, GPU 0 waits. :class:`PipelinedRunner`
splits each engine iteration's rows into micro-batches and runs them through the micro-batch schedule of
:mod:`loaders.run.multi_gpu_schedule` (a worker thread, and on GPUs a CUDA stream, per device run of layers; no host
synchronisation inside a step), so run *i* computes micro-batch *j* while run *i+1* computes *j-1*.

Nothing about a forward is defined twice: each micro-batch's calls are the plain :class:`~service.engine.model_runner.ModelRunner`'s
own (:meth:`~service.engine.model_runner.ModelRunner.prepare`: ids, positions, the prepared mask, and a view of the slot
cache bound to that micro-batch's rows, which the captured layer arguments carry to every device run), and their
logits are read back by its :meth:`~service.engine.model_runner.ModelRunner.collect`. So the answer is the same
:class:`~service.engine.model_runner.RunOutput`, for decode rows and packed prefill chunks alike; a micro-batch whose rows
have different widths is one packed call, as a whole iteration would be.

:func:`make_runner` decides, once, at engine start: the pipeline is used when the loaded model's decoder layers
(found by :func:`loaders.run.multi_gpu_schedule.find_decoder_layers`) sit on two or more distinct GPUs of its device map
and nothing else, its attention takes one mask for every layer, and its forward hands the layers keyword arguments
only. Otherwise the plain runner is used, and :class:`DevicePipelineReport` says why (``/info``). An explicit
``--micro-batches`` that the chosen runner cannot honour is refused with that reason, never ignored.

``standin_runs`` is a test-only hook: it splits the layers into that many runs of stand-in devices that all compute
on the CPU, so that the serving path is exercised on a machine without GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from loaders.run.multi_gpu_schedule import (
    LayerCapture,
    MicroBatchSchedule,
    find_decoder_layers,
    layer_devices,
    pipelined_forward,
    split_runs,
)
from planner.hardware.devices import is_gpu
from service.engine.kv_pool import SlotKVCache
from service.engine.model_runner import ModelRunner, Row, RunOutput

log = logging.getLogger(__name__)

#: Micro-batches per device run when ``--micro-batches`` is not given: enough to keep every run busy while the
#: first and last fill and drain, without cutting a batch into slivers.
MICRO_BATCHES_PER_RUN = 2


@dataclass(frozen=True)
class DevicePipelineReport:
    """Whether the engine runs its iterations through the device pipeline, over which runs, and why (or why not)."""

    active: bool
    reason: str
    runs: int = 0  # device runs of decoder layers (0 when inactive)
    devices: list[str] = field(default_factory=list)  # each run's device label, in layer order
    layers: list[list[int]] = field(default_factory=list)  # each run's first and last layer
    micro_batches: int = 0  # most micro-batches one iteration is split into (fewer when it has fewer rows)
    standin: bool = False  # the runs are test-only stand-ins computing on the CPU

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PipelinedRunner:
    """Runs :class:`Row`\\ s like :class:`ModelRunner`, micro-batch by micro-batch over the model's device runs."""

    def __init__(
        self, plain: ModelRunner, capture: LayerCapture, labels: Sequence[object], micro_batches: int | None = None
    ):
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.plain = plain
        self.device = plain.device
        self.capture = capture
        self.runs = split_runs(capture.layers, labels)
        #: Most micro-batches per iteration (default: MICRO_BATCHES_PER_RUN per device run).
        self.micro_batches = micro_batches or MICRO_BATCHES_PER_RUN * len(self.runs)
        self.schedule = MicroBatchSchedule(self.runs)
        #: Model calls run so far (each micro-batch's call is one), as :attr:`ModelRunner.forwards` counts them.
        self.forwards = 0
        #: Iterations run through the pipeline, and micro-batches in all (``/metrics``).
        self.steps = 0
        self.micro_batches_run = 0

    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """Feed every row's tokens; return the logits after each row's last token, ``[B, vocab]``."""
        return self.run(rows).last

    @torch.inference_mode()
    def run(self, rows: Sequence[Row]) -> RunOutput:
        """Every row's tokens, in up to ``micro_batches`` micro-batches of consecutive rows, overlapped over the
        device runs; the same :class:`RunOutput` as the plain runner's."""
        if not rows:
            raise ValueError("a forward needs at least one row")
        m = min(self.micro_batches, len(rows))
        bounds = [(len(rows) * j // m, len(rows) * (j + 1) // m) for j in range(m)]
        calls = [c.shifted(lo) for lo, hi in bounds for c in self.plain.prepare(rows[lo:hi])]
        outs = pipelined_forward(self.capture, self.schedule, [c.kwargs(self.device) for c in calls])
        self.forwards += len(calls)
        self.steps += 1
        self.micro_batches_run += len(calls)
        return ModelRunner.collect(rows, calls, [o.logits for o in outs])

    def close(self) -> None:
        """Stop the run workers and put the model's layers back (idempotent)."""
        self.schedule.close()
        self.capture.remove()


Runner = ModelRunner | PipelinedRunner


def make_runner(
    model: Any,
    device: torch.device,
    cache: SlotKVCache,
    *,
    micro_batches: int | None = None,
    standin_runs: int | None = None,
) -> tuple[Runner, DevicePipelineReport]:
    """The engine's runner for ``model`` and the report of that choice (see the module docstring).

    Raises ``ValueError`` naming ``--micro-batches`` when it was given but the model does not run pipelined here."""
    plain = ModelRunner(model, device, cache)
    found = _layout(model, plain, standin_runs)
    if isinstance(found, str):
        if micro_batches is not None:
            raise ValueError(
                f"--micro-batches {micro_batches} (LOADMASTER_MICRO_BATCHES) splits each step over the device runs "
                f"of a model whose decoder layers span two or more GPUs of this host, or over the ranks of a "
                f"--pipeline; here the device pipeline is off: {found}. Drop --micro-batches, or plan over several "
                "GPUs (e.g. --max-memory 0=20GiB,1=20GiB)."
            )
        return plain, DevicePipelineReport(active=False, reason=found)
    container, labels = found
    capture = LayerCapture(model, container)
    refusal = _probe(capture, plain)
    if refusal is not None:
        capture.remove()
        if micro_batches is not None:
            raise ValueError(f"--micro-batches {micro_batches} cannot be honoured: {refusal}. Drop --micro-batches.")
        return plain, DevicePipelineReport(active=False, reason=refusal)
    runner = PipelinedRunner(plain, capture, labels, micro_batches)
    runs, m = runner.runs, runner.micro_batches
    report = DevicePipelineReport(
        active=True,
        reason=(
            f"decoder layers on {len(runs)} stand-in device runs (test only, all on the CPU)"
            if standin_runs
            else f"decoder layers on {len(runs)} GPUs of this host"
        ),
        runs=len(runs),
        devices=[r.label for r in runs],
        layers=[[r.first, r.last] for r in runs],
        micro_batches=m,
        standin=bool(standin_runs),
    )
    log.info(
        "device pipeline: %d runs (%s), up to %d micro-batches per step",
        report.runs,
        ", ".join(f"{d}: layers {a}-{b}" for d, (a, b) in zip(report.devices, report.layers)),
        m,
    )
    return runner, report


def _layout(model: Any, plain: ModelRunner, standin_runs: int | None) -> tuple[str, list[object]] | str:
    """The decoder layers' container and each layer's device label, or why the model does not run pipelined."""
    if not isinstance(model, torch.nn.Module):
        return f"{type(model).__name__} is not a module whose layers this process holds"
    container = find_decoder_layers(model)
    if container is None:
        return "no ModuleList of decoder layers was found in the model"
    if plain.mixed:
        return "its attention mixes full and sliding-window layers, whose per-layer masks one capture cannot carry"
    count = len(model.get_submodule(container))
    if standin_runs:
        k = min(standin_runs, count)
        return container, [f"standin-{i * k // count}" for i in range(count)]
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return "the model carries no device map: every decoder layer is on one device"
    labels = layer_devices(device_map, container, count)
    if labels is None:
        return "the device map splits a decoder layer over devices or does not place one"
    gpus = sorted({d for d in labels if is_gpu(d)})
    others = sorted({str(d) for d in labels if not is_gpu(d)})
    if others and gpus:
        return f"decoder layers on {', '.join(others)} next to GPUs: offloaded layers run one device at a time"
    if len(gpus) < 2:
        where = f"GPU {gpus[0]}" if gpus else ", ".join(others) or "one device"
        return f"every decoder layer is on {where}"
    return container, labels


def _probe(capture: LayerCapture, plain: ModelRunner) -> str | None:
    """Capture a one-token forward up to the first layer (nothing is written to the cache): why the capture cannot
    cut this model's forward, or None."""
    call = plain.prepare([Row(0, 0, [0])])[0]
    try:
        capture.inputs(**call.kwargs(plain.device))
    except TypeError as exc:
        return f"the model's decoder layers take positional arguments, which the layer capture does not carry ({exc})"
    return None
