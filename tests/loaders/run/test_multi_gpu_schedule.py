"""The micro-batch schedule within one host (:mod:`loaders.run.multi_gpu_schedule`), on stand-in devices: a real
transformers model whose decoder layers are split into runs that each have their own worker (all computing on the
CPU here). Greedy tokens equal the model's own ``generate``; with every run made artificially slow (the test-only
``delay_s``), a step of m micro-batches over k runs takes about (m + k - 1) run-times, not m x k."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from loaders.run.multi_gpu_schedule import (
    LayerCapture,
    MicroBatchSchedule,
    find_decoder_layers,
    layer_devices,
    pipelined_forward,
    split_runs,
)

PROMPTS = ["The old lighthouse keeper", "Hello there", "Once upon a time in a quiet village"]


@pytest.fixture
def split_model(request, tiny_llama: Path) -> Iterator[tuple]:
    """tiny Llama with its layers split into runs by the stand-in labels ``request.param``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    capture = LayerCapture(model, "model.layers")
    yield model, capture, split_runs(capture.layers, request.param), AutoTokenizer.from_pretrained(tiny_llama)
    capture.remove()


def _greedy(model, capture, schedule, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding, one micro-batch per prompt (each with its own KV cache), every step pipelined."""
    caches = [DynamicCache(config=model.config) for _ in prompts]
    feed = [torch.tensor([p]) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        calls = [dict(input_ids=f, cache=c, use_cache=True, logits_to_keep=1) for f, c in zip(feed, caches)]
        for i, out in enumerate(pipelined_forward(capture, schedule, calls)):
            token = int(out.logits[0, -1].argmax())
            new[i].append(token)
            feed[i] = torch.tensor([[token]])
    return new


@pytest.mark.parametrize("split_model", [["gpu-a", "gpu-a", "gpu-b", "gpu-c"]], indirect=True)
def test_pipelined_greedy_tokens_equal_generate(split_model) -> None:
    model, capture, runs, tok = split_model
    assert [(r.first, r.last) for r in runs] == [(0, 1), (2, 2), (3, 3)]
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    schedule = MicroBatchSchedule(runs)
    try:
        got = _greedy(model, capture, schedule, ids, 6)
    finally:
        schedule.close()
    capture.remove()  # the model as it was: its own generate is the reference
    for prompt, tokens in zip(ids, got):
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert tokens == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("split_model", [["gpu-a", "gpu-a", "gpu-b", "gpu-b"]], indirect=True)
def test_a_step_of_m_micro_batches_over_k_runs_overlaps(split_model) -> None:
    model, capture, runs, tok = split_model
    m, k, d = 4, len(runs), 0.25
    assert k == 2
    items = [capture.inputs(**tok(PROMPTS[j % len(PROMPTS)], return_tensors="pt"), use_cache=False) for j in range(m)]
    schedule = MicroBatchSchedule(runs, delay_s=d)
    try:
        t0 = time.perf_counter()
        outs = schedule.step(items)
        took = time.perf_counter() - t0
    finally:
        schedule.close()
    assert len(outs) == m and all(o.shape == i[0].shape for o, i in zip(outs, items))
    assert (m + k - 1) * d <= took < (m * k - 1) * d, f"{took:.2f}s for m={m}, k={k}, d={d}"


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="2 layers but 1 device labels"):
        split_runs([torch.nn.Identity(), torch.nn.Identity()], ["cpu"])
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        MicroBatchSchedule(split_runs([torch.nn.Identity()], ["cpu"]), delay_s=-1)


def test_decoder_layers_and_their_devices_are_read_from_the_model_and_its_map(
    tiny_llama: Path, tiny_gpt2: Path
) -> None:
    assert find_decoder_layers(AutoModelForCausalLM.from_pretrained(tiny_llama)) == "model.layers"
    assert find_decoder_layers(AutoModelForCausalLM.from_pretrained(tiny_gpt2)) == "transformer.h"
    two_gpus = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    assert layer_devices(two_gpus, "model.layers", 2) == [0, 1]
    assert layer_devices({"": "cpu"}, "model.layers", 2) == ["cpu", "cpu"]
    assert layer_devices({"model": 0, "model.layers.1.mlp": 1}, "model.layers", 2) is None  # layer 1 is split
    assert layer_devices({"model.layers.0": 0}, "model.layers", 2) is None  # layer 1 is not placed


class _StreamLog:
    """Stand-in CUDA streams and events that record the order of launches, records and waits (issue 34 defect 2).

    Each thread's current stream per device is the "caller's" stream until a ``torch.cuda.stream`` context names
    another, as in CUDA; a layer's launch is logged on the stream current at that moment."""

    def __init__(self) -> None:
        import threading

        self.log: list[tuple] = []
        self.local = threading.local()
        self.lock = threading.Lock()
        log = self

        class Stream:
            def __init__(self, device=None):
                self.name = f"worker-{torch.device(device).index}"

            def wait_event(self, event):
                log.add("wait", self.name, event.on)

        class Event:
            def record(self, stream=None):
                self.on = stream.name
                log.add("record", stream.name)

            def synchronize(self):
                pass

        self.Stream, self.Event = Stream, Event

    def add(self, *entry) -> None:
        with self.lock:
            self.log.append(entry)

    def current(self, device=None):
        class Caller:
            name = f"caller-{device.index if device is not None else '?'}"

        return getattr(self.local, "stream", None) or Caller()

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.local.stream = s
            try:
                yield
            finally:
                self.local.stream = None

        return ctx()


class _Launch(torch.nn.Module):
    def __init__(self, streams: _StreamLog, name: str):
        super().__init__()
        self.streams, self.name = streams, name

    def forward(self, hidden, **kwargs):
        self.streams.add("launch", self.streams.current().name, self.name)
        return hidden + 1


def test_each_run_waits_for_the_callers_stream_on_its_device_before_its_first_launch(monkeypatch) -> None:
    """The engine thread queues the embedding, rotary and KV cache copies on its own current stream of each device;
    every run's stream must wait on an event recorded there after them, before launching a layer (defect 2)."""
    import contextlib

    from loaders.run import multi_gpu_schedule as mgs

    streams = _StreamLog()
    monkeypatch.setattr(torch.cuda, "Stream", streams.Stream)
    monkeypatch.setattr(torch.cuda, "Event", streams.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", streams.current)
    monkeypatch.setattr(torch.cuda, "stream", streams.stream)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(mgs, "_to", lambda value, device: value)  # the tensors stay on the CPU
    runs = [
        mgs.DeviceRun(torch.device("cuda", 0), [_Launch(streams, "layer0")], 0, "0"),
        mgs.DeviceRun(torch.device("cuda", 1), [_Launch(streams, "layer1")], 1, "1"),
    ]
    schedule = MicroBatchSchedule(runs)
    try:
        streams.add("launch", "caller-0", "embedding")  # the engine's own launches, before the step
        streams.add("launch", "caller-1", "cache growth")
        out = schedule.step([(torch.zeros(2), {}), (torch.ones(2), {})])
    finally:
        schedule.close()
    assert [o.tolist() for o in out] == [[2.0, 2.0], [3.0, 3.0]]
    log = streams.log
    for k in (0, 1):
        first = next(i for i, e in enumerate(log) if e[:2] == ("launch", f"worker-{k}"))
        recorded = max(i for i, e in enumerate(log[:first]) if e == ("record", f"caller-{k}"))
        assert log.index(("launch", f"caller-{k}", "embedding" if k == 0 else "cache growth")) < recorded
        assert ("wait", f"worker-{k}", f"caller-{k}") in log[recorded:first], log
