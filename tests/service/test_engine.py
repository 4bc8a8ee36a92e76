"""The engine without HTTP: batched greedy decoding equals transformers' generate on every tiny architecture,
and a failing step (out of memory, or any error) fails only that step's requests."""

from __future__ import annotations

import queue
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.engine import Engine, ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from service.errors import NotReadyError
from service.sampling import SamplingParams

PROMPTS = ["Once upon a time", "Hello", "The sea was calm and the night was long", "A", "Rain fell", "Why not"]


def _run(engine: Engine, requests: list[GenerationRequest]) -> list[list]:
    sinks = [queue.Queue() for _ in requests]
    for req, sink in zip(requests, sinks):
        engine.submit(req, sink.put)
    results = []
    for sink in sinks:
        events = []
        while True:
            ev = sink.get(timeout=60)
            events.append(ev)
            if isinstance(ev, (FinishEvent, ErrorEvent)):
                break
        results.append(events)
    return results


@pytest.fixture(params=["tiny_llama", "tiny_gpt2", "tiny_moe"])
def model_and_tokenizer(request):
    path: Path = request.getfixturevalue(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_batched_greedy_equals_transformers_generate(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    engine = Engine(model, tok, max_batch_size=4, max_queue=16)  # 6 requests: joins happen mid-decode
    engine.start()
    try:
        reqs = [
            GenerationRequest(prompt_ids=tok(p)["input_ids"], max_new_tokens=10 + 3 * i) for i, p in enumerate(PROMPTS)
        ]
        results = _run(engine, reqs)
    finally:
        engine.stop()
    assert engine.peak_batch >= 2
    eos = engine.eos
    for req, events in zip(reqs, results):
        final = events[-1]
        assert isinstance(final, FinishEvent), final
        ids = torch.tensor([req.prompt_ids])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=req.max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=list(eos) or None,
        )
        want = ref[0, len(req.prompt_ids) :].tolist()
        got = [e.id for e in events if isinstance(e, TokenEvent)]
        assert got == want
        assert final.generated_tokens == len(got)
        assert final.reason == ("eos_token" if got[-1] in eos else "length")


class _FailingForward:
    """Wraps a model's forward to raise once on the next decode step (one new token per row)."""

    def __init__(self, model: torch.nn.Module, exc: Exception):
        self.model, self.exc, self.armed = model, exc, False
        self.original = model.forward
        model.forward = self

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        if self.armed and ids is not None and ids.shape[1] == 1:
            self.armed = False
            if callable(self.exc):
                self.exc()  # a real failure, raised by torch itself
            raise self.exc
        return self.original(*args, **kwargs)


def allocate_a_pebibyte() -> None:
    """What a CPU out-of-memory really looks like: torch's allocator refusing (its message has no "out of memory")."""
    torch.empty(1 << 50, dtype=torch.uint8)
    raise AssertionError("a 1 PiB allocation succeeded")


@pytest.mark.parametrize(
    "exc,mentions",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "Out of memory"),
        (allocate_a_pebibyte, "Out of memory"),
        (ValueError("some model bug"), "ValueError"),
    ],
)
def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_llama: Path, exc, mentions) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    fault = _FailingForward(model, exc)
    engine = Engine(model, tok, max_batch_size=4, max_queue=8)
    engine.start()
    try:
        ids = tok("Hello")["input_ids"]
        fault.armed = True
        failed = _run(
            engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=5, request_id=f"r{i}") for i in range(2)]
        )
        for events in failed:
            err = events[-1]
            assert isinstance(err, ErrorEvent) and err.error_type == "generation"
            assert mentions in err.message and "Traceback" not in err.message
        ok = _run(engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=5)])[0]
        assert isinstance(ok[-1], FinishEvent) and ok[-1].generated_tokens == 5
        assert engine.active == 0
    finally:
        engine.stop()


def test_seeded_sampling_does_not_depend_on_batch_neighbours(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = Engine(model, tok, max_batch_size=8, max_queue=16)
    engine.start()
    try:
        params = SamplingParams(do_sample=True, temperature=0.9, top_p=0.9, seed=42)
        req = GenerationRequest(prompt_ids=tok("Hello")["input_ids"], max_new_tokens=12, params=params)
        alone = _run(engine, [req])[0]
        others = [
            GenerationRequest(
                prompt_ids=tok(p)["input_ids"], max_new_tokens=12, params=SamplingParams(do_sample=True, seed=i)
            )
            for i, p in enumerate(PROMPTS)
        ]
        crowded = _run(engine, others[:3] + [req] + others[3:])[3]
    finally:
        engine.stop()
    assert [e.id for e in alone if isinstance(e, TokenEvent)] == [e.id for e in crowded if isinstance(e, TokenEvent)]


def test_stop_fails_queued_requests_with_not_ready_and_refuses_new_ones(tiny_llama: Path) -> None:
    from service.errors import NotReadyError

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = Engine(model, tok, max_batch_size=1, max_queue=4)  # never started: requests stay queued
    sink: queue.Queue = queue.Queue()
    for _ in range(2):
        engine.submit(GenerationRequest(prompt_ids=tok("Hi")["input_ids"], max_new_tokens=3), sink.put)
    engine.stop()
    events = [sink.get_nowait() for _ in range(2)]
    assert all(isinstance(e, ErrorEvent) and e.error_type == "not_ready" for e in events)
    with pytest.raises(NotReadyError):
        engine.submit(GenerationRequest(prompt_ids=[1], max_new_tokens=1), sink.put)


def test_a_full_queue_is_overloaded(tiny_llama: Path) -> None:
    from service.errors import OverloadedError

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = Engine(model, tok, max_batch_size=1, max_queue=2)
    for _ in range(2):
        engine.submit(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=1), lambda e: None)
    with pytest.raises(OverloadedError):
        engine.submit(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=1), lambda e: None)
    engine.stop()


def test_a_broken_sink_ends_only_its_own_sequence(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = Engine(model, tok, max_batch_size=4, max_queue=8)
    engine.start()
    try:
        calls = []

        def broken(event) -> None:
            calls.append(event)
            if len(calls) == 3:
                raise RuntimeError("sink exploded")

        ids = tok("Hello")["input_ids"]
        engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=20), broken)
        ok = _run(engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=20)])[0]
        assert isinstance(ok[-1], FinishEvent) and ok[-1].generated_tokens == 20
        assert engine.alive
        assert isinstance(calls[-1], ErrorEvent) and len(calls) == 4  # 3 tokens, then the error, nothing more
    finally:
        engine.stop()
    assert not engine.alive


def test_compute_starts_on_the_first_gpu_even_with_the_embeddings_on_the_host(tiny_llama: Path) -> None:
    """Issue 14 item 3: with the embeddings offloaded, the engine put token ids (and so logits and sampling) on the
    CPU, where the embedding weight lives. The device map's first GPU is where compute happens."""
    from service.engine import input_device

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": 1, "lm_head": 0, "model.norm": 0}
    assert input_device(model) == torch.device("cuda", 0)
    model.hf_device_map = {"": "cpu"}
    assert input_device(model) == torch.device("cpu")


def _illegal_access() -> None:
    raise RuntimeError(
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported "
        "at some other API call, so the stacktrace below might be incorrect."
    )


def test_an_unrecoverable_cuda_error_stops_the_engine_and_fails_every_request(tiny_llama: Path) -> None:
    """Issue 14 item 7: after "an illegal memory access" every later kernel fails; the engine treated it as one
    request's failure and kept reporting ready. Now it stops: in-flight and queued requests fail saying why and
    what to do, ``alive`` (which readiness reads) turns false, and new requests are refused with the reason."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    fault = _FailingForward(model, _illegal_access)
    engine = Engine(model, tok, max_batch_size=2, max_queue=8)
    engine.start()
    try:
        ids = tok("Hello")["input_ids"]
        fault.armed = True
        results = _run(
            engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=50, request_id=f"r{i}") for i in range(4)]
        )
        for events in results:
            err = events[-1]
            assert isinstance(err, ErrorEvent) and err.error_type == "not_ready", err
            assert "unrecoverable" in err.message and "Restart the server" in err.message
            assert "illegal memory access" in err.message
        engine._thread.join(10)
        assert not engine.alive and engine.dead is not None
        with pytest.raises(NotReadyError, match="unrecoverable"):
            engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=1), lambda e: None)
    finally:
        engine.stop()


def test_the_allocator_cache_is_released_only_once_the_failed_step_is_gone(tiny_llama: Path, monkeypatch) -> None:
    """Issue 14 item 7: ``empty_cache()`` ran inside the failure handler, while the failed group's KV cache (and the
    exception's frames) still held the memory it was meant to give back. It now runs after the step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    caches: list[weakref.ref] = []
    alive_at_release: list[bool] = []

    class Probe(_FailingForward):
        def __call__(self, *args, **kwargs):
            if self.armed and kwargs["input_ids"].shape[1] == 1:
                cache = kwargs.get("cache", kwargs.get("past_key_values"))
                caches.append(weakref.ref(cache))
            return super().__call__(*args, **kwargs)

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    fault = Probe(model, oom)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the engine's only CUDA question here
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_release.append(caches[-1]() is not None))
    engine = Engine(model, tok, max_batch_size=2, max_queue=8)
    engine.start()
    try:
        ids = tok("Hello")["input_ids"]
        fault.armed = True
        failed = _run(
            engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=5, request_id=f"r{i}") for i in range(2)]
        )
        assert all(isinstance(events[-1], ErrorEvent) for events in failed)
        ok = _run(engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=3)])[0]
        assert isinstance(ok[-1], FinishEvent)
    finally:
        engine.stop()
    assert caches and alive_at_release == [False], "empty_cache ran while the failed step's KV cache was referenced"
