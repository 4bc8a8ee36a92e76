"""The micro-batch schedule within one host: a model whose decoder layers span several devices, in one process.

A device map that puts layers 0-15 on GPU 0 and 16-31 on GPU 1 runs, as accelerate runs it, one GPU at a time.
Here each device's contiguous run of layers (a :class:`DeviceRun`) is driven by its own worker thread fed by a
queue, and a step's rows are split into micro-batches: while run 1 computes micro-batch j, run 0 computes j+1, so
a step of m micro-batches over k runs takes about (m + k - 1) run-times instead of m x k.

- On GPUs every run launches on its own CUDA stream; a micro-batch's hidden states carry the event recorded after
  the producing run's last launch, and the next run's stream waits on that event (``wait_event``, on the device)
  before copying them over. No host synchronisation happens inside a step: the host only waits for the last
  run's event of each micro-batch when it reads the result.
- The step's own inputs come from the caller's thread (the engine's): the embedding and rotary, the KV cache's
  ``copy_prefix`` and its growth are queued on *that thread's* current stream of each device. So ``step`` records
  an event on the caller's current stream of every device a run is on, and each run's stream waits on its
  device's event before its first launch (issue 34, defect 2: without it layer 0 could read hidden states, and a
  layer write cache rows, that the caller's stream had not produced yet).
- On the CPU (and for the stand-in devices the tests use: labels that all execute on the CPU) the queue's order is
  the dependency.

:class:`LayerCapture` cuts a transformers decoder's forward around its layers without re-implementing it: a
forward in ``capture`` mode stops at the first layer and keeps what the model hands its layers (hidden states,
mask, rotary position embeddings, cache, positions); the schedule runs the layers; a forward in ``head`` mode then
lets the first layer return the final hidden states and the others pass them through, so the model's own final
norm and head compute the logits. :func:`find_decoder_layers` and :func:`layer_devices` say where a loaded model's
decoder layers are and which device of its device map each is on. Every pass runs in inference mode, as the
serving engine's forwards do, so the KV cache tensors the workers write are the engine's own. ``delay_s`` is a
test-only hook: each run takes at least that long per micro-batch, so that overlap is measurable on a machine whose
cores the runs share.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.hardware.devices import is_gpu
from planner.placement.hf_device_map import covering_key

#: What a run's worker receives: (micro-batch index, hidden states, the layers' keyword arguments, the producing
#: run's CUDA event, the caller's events by device).
_Item = tuple[int, torch.Tensor, dict[str, Any], Any, dict[torch.device, Any]]
_STOP = object()


@dataclass
class DeviceRun:
    """One device's contiguous run of decoder layers, and the device its work is launched on."""

    device: torch.device
    layers: list[torch.nn.Module]
    first: int
    label: str = ""

    @property
    def last(self) -> int:
        return self.first + len(self.layers) - 1


def split_runs(layers: Sequence[torch.nn.Module], labels: Sequence[object]) -> list[DeviceRun]:
    """Group consecutive layers with the same label (a device map's entry: GPU index, ``"cpu"``, ``"disk"``, or
    any stand-in name) into runs. A GPU index launches on that GPU; anything else computes on the CPU."""
    if len(layers) != len(labels):
        raise ValueError(f"{len(layers)} layers but {len(labels)} device labels; give one label per layer")
    if not layers:
        raise ValueError("a device pipeline needs at least one layer")
    runs: list[DeviceRun] = []
    for i, (layer, label) in enumerate(zip(layers, labels)):
        if runs and runs[-1].label == str(label):
            runs[-1].layers.append(layer)
            continue
        device = torch.device("cuda", label) if is_gpu(label) else torch.device("cpu")
        runs.append(DeviceRun(device, [layer], i, str(label)))
    return runs


def _to(value: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples, lists and dicts) on ``device``; anything else (a cache object) as is."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


@dataclass
class _Worker:
    run: DeviceRun
    inbox: queue.Queue = field(default_factory=queue.Queue)
    stream: Any = None
    thread: threading.Thread | None = None


class MicroBatchSchedule:
    """Run micro-batches through a model's device runs, each run on its own worker (see the module docstring).

    ``step`` takes every micro-batch's hidden states and layer arguments (as :class:`LayerCapture` captured them)
    and returns each micro-batch's output hidden states, in order. Errors in a worker are raised by ``step``.
    """

    def __init__(self, runs: Sequence[DeviceRun], *, delay_s: float = 0.0):
        if not runs:
            raise ValueError("a micro-batch schedule needs at least one device run")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.runs = list(runs)
        self.delay_s = delay_s
        self.done: queue.Queue = queue.Queue()
        self.workers = [_Worker(r) for r in self.runs]
        for w in self.workers:
            if w.run.device.type == "cuda":
                w.stream = torch.cuda.Stream(w.run.device)
        for k, w in enumerate(self.workers):
            nxt = self.workers[k + 1].inbox if k + 1 < len(self.workers) else self.done
            w.thread = threading.Thread(target=self._serve, args=(w, nxt), name=f"loadmaster-run-{k}", daemon=True)
            w.thread.start()

    def step(self, items: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> list[torch.Tensor]:
        """Every micro-batch through every run, overlapped; their output hidden states in micro-batch order."""
        entry = self._caller_events()
        for j, (hidden, kwargs) in enumerate(items):
            self.workers[0].inbox.put((j, hidden, kwargs, None, entry))
        out: dict[int, torch.Tensor] = {}
        failure: BaseException | None = None
        for _ in items:
            j, hidden, _, event, _ = self.done.get()
            if isinstance(hidden, BaseException):
                failure = failure or hidden
                continue
            if event is not None:
                event.synchronize()  # the step's end: the host reads the result
            out[j] = hidden
        if failure is not None:
            raise failure
        return [out[j] for j in range(len(items))]

    def _caller_events(self) -> dict[torch.device, Any]:
        """An event recorded on the calling thread's current stream of each GPU a run is on: what the caller queued
        there (embedding, rotary, cache copies and growth) must come before any run's launches."""
        events: dict[torch.device, Any] = {}
        for w in self.workers:
            if w.stream is not None and w.run.device not in events:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(w.run.device))
                events[w.run.device] = event
        return events

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for w in self.workers:
            if w.thread is not None and w.thread.is_alive():
                w.inbox.put(_STOP)
        for w in self.workers:
            if w.thread is not None:
                w.thread.join(timeout=10)

    def _serve(self, worker: _Worker, nxt: queue.Queue) -> None:
        while True:
            item = worker.inbox.get()
            if item is _STOP:
                return
            j, hidden, kwargs, event, entry = item
            if isinstance(hidden, BaseException):  # an earlier run failed: pass the failure on
                nxt.put(item)
                continue
            t0 = time.perf_counter()
            try:
                hidden, event = self._run(worker, hidden, kwargs, (event, entry.get(worker.run.device)))
            except BaseException as exc:  # noqa: BLE001 - handed to step(), which raises it on the caller's thread
                nxt.put((j, exc, kwargs, None, entry))
                continue
            rest = self.delay_s - (time.perf_counter() - t0)
            if rest > 0:  # test-only: a run made artificially slow
                time.sleep(rest)
            nxt.put((j, hidden, kwargs, event, entry))

    @staticmethod
    def _run(worker: _Worker, hidden: torch.Tensor, kwargs: dict[str, Any], waits: tuple) -> tuple[torch.Tensor, Any]:
        """``waits``: the producing run's event and the caller's event on this run's device (either may be None)."""
        run = worker.run
        if worker.stream is None:  # CPU: the queue's order is the dependency
            kw = _to(kwargs, run.device)
            hidden = _to(hidden, run.device)
            with torch.inference_mode():
                for layer in run.layers:
                    hidden = layer(hidden, **kw)
            return hidden, None
        with torch.cuda.device(run.device), torch.cuda.stream(worker.stream):
            for event in waits:
                if event is not None:
                    worker.stream.wait_event(event)  # on the device: the producer's and the caller's launches first
            src = hidden
            hidden = _to(hidden, run.device)
            if src.device.type == "cuda":
                src.record_stream(worker.stream)  # the producer's allocator must not reuse it before this copy
            kw = _to(kwargs, run.device)
            with torch.inference_mode():
                for layer in run.layers:
                    hidden = layer(hidden, **kw)
            done = torch.cuda.Event()
            done.record(worker.stream)
        return hidden, done


class _Captured(Exception):
    """Raised by the first layer's gate in capture mode: the model's forward stops there."""


class _Gate(torch.nn.Module):
    """A decoder layer's stand-in while a :class:`LayerCapture` is installed."""

    def __init__(self, capture: LayerCapture, index: int, layer: torch.nn.Module):
        super().__init__()
        self.capture = capture
        self.index = index
        self.layer = layer

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cap = self.capture
        if cap.mode == "capture":
            if args:
                raise TypeError("a decoder layer got positional arguments besides its hidden states; cannot capture")
            cap.captured = (hidden, kwargs)
            raise _Captured
        if cap.mode == "head":
            return cap.result if self.index == 0 else hidden
        return self.layer(hidden, *args, **kwargs)


class LayerCapture:
    """Install gates around ``model``'s decoder layers (the ``container``'s ModuleList) to cut its forward there."""

    def __init__(self, model: torch.nn.Module, container: str):
        self.model = model
        self.container = model.get_submodule(container)
        if not isinstance(self.container, torch.nn.ModuleList):
            raise TypeError(f"{container} is not a ModuleList of decoder layers")
        self.layers = list(self.container)
        self.mode = "plain"
        self.captured: tuple[torch.Tensor, dict[str, Any]] | None = None
        self.result: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            self.container[i] = _Gate(self, i, layer)

    def inputs(self, **forward_kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The hidden states and keyword arguments the model hands its first layer for this call."""
        self.mode, self.captured = "capture", None
        try:
            with torch.inference_mode():
                self.model(**forward_kwargs)
        except _Captured:
            pass
        finally:
            self.mode = "plain"
        if self.captured is None:
            raise RuntimeError("the model's forward never reached its first decoder layer")
        hidden, kwargs = self.captured
        self.captured = None
        return hidden, kwargs

    def head(self, hidden: torch.Tensor, **forward_kwargs: Any) -> Any:
        """The model's output (logits) for final hidden states ``hidden``: its own final norm and head."""
        self.mode, self.result = "head", hidden
        try:
            with torch.inference_mode():
                return self.model(**forward_kwargs)
        finally:
            self.mode, self.result = "plain", None

    def remove(self) -> None:
        """Put the layers back."""
        for i, layer in enumerate(self.layers):
            self.container[i] = layer


def pipelined_forward(
    capture: LayerCapture,
    schedule: MicroBatchSchedule,
    calls: Sequence[dict[str, Any]],
    head_kwargs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> list[Any]:
    """One step: each call's forward (one micro-batch's ``model(**call)``) with the layers run by ``schedule``.
    ``head_kwargs`` adjusts a call for its head pass (default: the same call)."""
    items = [capture.inputs(**call) for call in calls]
    outs = schedule.step(items)
    return [capture.head(h, **(head_kwargs(c) if head_kwargs else c)) for h, c in zip(outs, calls)]


def find_decoder_layers(model: torch.nn.Module) -> str | None:
    """The dotted name of ``model``'s ModuleList of decoder layers (``model.layers``, ``transformer.h``, ...): the
    first ModuleList with as many entries as the config's hidden layers; ``None`` if there is none."""
    config = getattr(model, "config", None)
    count = next(
        (v for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(v := getattr(config, k, None), int)),
        None,
    )
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and count:
            return name
    return None


def layer_devices(device_map: Mapping[str, object], container: str, count: int) -> list[object] | None:
    """Each decoder layer's device in ``device_map`` (transformers' ``hf_device_map`` format: the entry that covers
    the layer); ``None`` when a layer is split over several devices or the map does not place it."""
    out: list[object] = []
    for i in range(count):
        name = f"{container}.{i}" if container else str(i)
        holder = covering_key(name, device_map)
        devices = {device_map[k] for k in device_map if k.startswith(name + ".")}
        if holder is not None:
            devices.add(device_map[holder])
        if len(devices) != 1:
            return None
        out.append(devices.pop())
    return out


__all__ = [
    "DeviceRun",
    "LayerCapture",
    "MicroBatchSchedule",
    "find_decoder_layers",
    "layer_devices",
    "pipelined_forward",
    "split_runs",
]
