"""The engine without HTTP: batched greedy decoding equals transformers' generate on every tiny architecture,
and a failing step (out of memory, or any error) fails only that step's requests."""

from __future__ import annotations

import queue
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.engine.engine import Engine
from service.engine.requests import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from service.engine.sampling import SamplingParams
from service.errors import GenerationError, NotReadyError

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
        # distinct prompts: identical ones would be prefilled once and the copy's last token fed alone
        failed = _run(
            engine,
            [
                GenerationRequest(prompt_ids=tok(p)["input_ids"], max_new_tokens=5, request_id=f"r{i}")
                for i, p in enumerate(["Hello", "Rain fell on the sea"])
            ],
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


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_identical_prompts_admitted_together_are_prefilled_once(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok("The sea was calm and the night was long, and the ships stayed in the harbor")["input_ids"]
    engine = Engine(model, tok, max_batch_size=4, max_queue=8)  # not started: all three are admitted together
    sinks = [queue.Queue() for _ in range(3)]
    for sink in sinks:
        engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=4), sink.put)
    engine.start()
    try:
        results = [_drain(sink) for sink in sinks]
    finally:
        engine.stop()
    # the first prompt whole; each copy only its last token (its logits are needed), the rest copied
    assert engine.prefilled_tokens == len(prompt) + 2
    assert engine.reused_tokens == 2 * (len(prompt) - 1)
    want = _greedy(model, prompt, 4)
    for events in results:
        assert [e.id for e in events if isinstance(e, TokenEvent)] == want
    assert engine.peak_batch == 3  # the copies started decoding with the first


def test_ignore_eos_generates_max_new_tokens_through_an_end_of_sequence_token(tiny_llama: Path) -> None:
    """``ignore_eos``: a fixed-length greedy run (the pipeline's batch driver) goes on through a chosen EOS token."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok("Once upon a time")["input_ids"]
    want = _greedy(model, prompt, 5)
    engine = Engine(model, tok, max_batch_size=2, max_queue=8)
    k = next(i for i in range(1, 5) if want[i] not in want[:i])  # the first repeat-free token after the first
    engine.eos = {want[k]}  # it ends the sequence, unless EOS is ignored
    engine.start()
    try:
        stopped, through = _run(
            engine,
            [
                GenerationRequest(prompt_ids=prompt, max_new_tokens=5),
                GenerationRequest(prompt_ids=prompt, max_new_tokens=5, ignore_eos=True),
            ],
        )
    finally:
        engine.stop()
    assert stopped[-1].reason == "eos_token" and [e.id for e in stopped if isinstance(e, TokenEvent)] == want[: k + 1]
    assert through[-1].reason == "length" and [e.id for e in through if isinstance(e, TokenEvent)] == want


def test_a_prompt_sharing_a_finished_requests_prefix_reuses_its_slot(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    system = tok("You are a helpful assistant who answers briefly and well. Question:")["input_ids"]
    first, second = system + tok("why", add_special_tokens=False)["input_ids"], system + [5, 6, 7]
    engine = Engine(model, tok, max_batch_size=2, max_queue=8)
    engine.start()
    try:
        _run(engine, [GenerationRequest(prompt_ids=first, max_new_tokens=3)])
        before = engine.prefilled_tokens
        got = _run(engine, [GenerationRequest(prompt_ids=second, max_new_tokens=5)])[0]
    finally:
        engine.stop()
    assert engine.reused_tokens >= len(system)
    assert engine.prefilled_tokens - before == len(second) - engine.reused_tokens
    assert [e.id for e in got if isinstance(e, TokenEvent)] == _greedy(model, second, 5)


def test_with_the_prefix_cache_off_every_prompt_is_prefilled_whole(tiny_llama: Path) -> None:
    """``prefix_cache=False``: the same prompt again, and copies submitted together, reuse nothing and decode the
    same tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok("You are a helpful assistant who answers briefly and well. Question: why")["input_ids"]
    engine = Engine(model, tok, max_batch_size=3, max_queue=8, prefix_cache=False)
    engine.start()
    try:
        first = _run(engine, [GenerationRequest(prompt_ids=prompt, max_new_tokens=4)])
        again = _run(engine, [GenerationRequest(prompt_ids=prompt, max_new_tokens=4) for _ in range(3)])
    finally:
        engine.stop()
    assert engine.reused_tokens == 0
    assert engine.prefilled_tokens == 4 * len(prompt)
    want = _greedy(model, prompt, 4)
    for events in first + again:
        assert [e.id for e in events if isinstance(e, TokenEvent)] == want


def test_admission_waits_for_kv_budget_tokens(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok("Rain fell")["input_ids"]
    # two slots, but tokens for only one of these requests at a time
    engine = Engine(model, tok, max_batch_size=2, max_queue=8, kv_budget_tokens=len(ids) + 30)
    engine.start()
    try:
        results = _run(engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=20) for _ in range(2)])
        with pytest.raises(GenerationError, match="tokens of KV cache"):
            engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=40), lambda e: None)
    finally:
        engine.stop()
    assert all(isinstance(r[-1], FinishEvent) and r[-1].generated_tokens == 20 for r in results)
    assert engine.peak_batch == 1


def test_a_long_prompt_is_prefilled_in_chunks_while_a_stream_keeps_decoding(tiny_llama: Path, monkeypatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    long_prompt = tok(" ".join(PROMPTS * 4))["input_ids"]
    assert len(long_prompt) > 5 * 8
    order: list[str] = []
    stream_started = queue.Queue()

    def stream_sink(ev) -> None:
        order.append("stream")
        stream_started.put(ev)

    engine = Engine(model, tok, max_batch_size=2, max_queue=8, prefill_chunk=8)
    engine.start()
    try:
        engine.submit(GenerationRequest(prompt_ids=tok("Hello")["input_ids"], max_new_tokens=60), stream_sink)
        stream_started.get(timeout=60)
        done = queue.Queue()

        def long_sink(ev) -> None:
            order.append("long")
            done.put(ev)

        engine.submit(GenerationRequest(prompt_ids=long_prompt, max_new_tokens=2), long_sink)
        first = done.get(timeout=60)
        assert isinstance(first, TokenEvent)
        want = _greedy(model, long_prompt, 1)[0]
        assert first.id == want
    finally:
        engine.stop()
    # the long prompt took several iterations to prefill, and the stream got a token in each
    before_long = order.index("long")
    assert order[:before_long].count("stream") >= 5


def _drain(sink: queue.Queue) -> list:
    events = []
    while True:
        ev = sink.get(timeout=60)
        events.append(ev)
        if isinstance(ev, (FinishEvent, ErrorEvent)):
            return events


def test_a_stop_sequence_found_off_the_decode_loop_ends_the_sequence(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok("Once upon a time")["input_ids"]
    free = _run_one(model, tok, GenerationRequest(prompt_ids=prompt, max_new_tokens=12))
    texts = [e.text for e in free if isinstance(e, TokenEvent)]
    k = next(i for i in range(2, len(texts)) if texts[i].strip() and texts[i] not in "".join(texts[:i]))
    stopped = _run_one(model, tok, GenerationRequest(prompt_ids=prompt, max_new_tokens=12, stop=(texts[k],)))
    final = stopped[-1]
    assert isinstance(final, FinishEvent) and final.reason == "stop_sequence"
    assert final.generated_tokens == k + 1 == len([e for e in stopped if isinstance(e, TokenEvent)])
    assert final.text == "".join(texts[: k + 1])


def _run_one(model, tok, request: GenerationRequest) -> list:
    engine = Engine(model, tok, max_batch_size=2, max_queue=4)
    engine.start()
    try:
        events = _run(engine, [request])[0]
        deadline = time.monotonic() + 30
        while engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.active == 0
    finally:
        engine.stop()
    return events


def test_half_on_disk_with_native_kernels_decodes_the_batch_as_plain_transformers(tiny_llama: Path, tmp_path) -> None:
    """The slot cache under the loader's execution: layers streamed from disk through hooks, native CPU kernels."""
    from loaders.load import load_model

    device_map = {"": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    model = load_model(tiny_llama, device_map, offload_folder=tmp_path / "offload", show_progress=False)
    assert "disk" in set(model.hf_device_map.values())
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = Engine(model, tok, max_batch_size=4, max_queue=8)
    engine.start()
    try:
        reqs = [GenerationRequest(prompt_ids=tok(p)["input_ids"], max_new_tokens=8) for p in PROMPTS[:4]]
        results = _run(engine, reqs)
    finally:
        engine.stop()
    assert engine.peak_batch >= 2
    for req, events in zip(reqs, results):
        got = [e.id for e in events if isinstance(e, TokenEvent)]
        ids = torch.tensor([req.prompt_ids])
        ref = plain.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=list(engine.eos) or None,
        )
        assert got == ref[0, len(req.prompt_ids) :].tolist()


def test_an_iteration_reads_each_offloaded_layer_once_while_a_prompt_prefills_and_a_stream_decodes(
    tiny_llama: Path, tmp_path, monkeypatch
) -> None:
    """One forward per iteration: the running stream's decode row rides in the long prompt's prefill forward, so
    a layer on disk is read once per iteration, not once for the prefill and again for the decode step."""
    from loaders.load import load_model

    device_map = {"": "cpu", "model.layers.1": "disk"}
    model = load_model(tiny_llama, device_map, offload_folder=tmp_path / "offload", show_progress=False)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    reads = [0]
    model.model.layers[1].register_forward_pre_hook(lambda module, args: reads.__setitem__(0, reads[0] + 1))
    engine = Engine(model, tok, max_batch_size=2, max_queue=8, prefill_chunk=8)
    iterations: list[tuple[int, int, int]] = []  # (decoding, prefilling, layer reads) of each iteration
    step = engine._step

    def counted_step() -> None:
        live = [s for s in engine.scheduler.running if not s.done]
        decoding = sum(1 for s in live if s.generated)
        prefilling = sum(1 for s in live if s.prefilling)
        before = reads[0]
        step()
        iterations.append((decoding, prefilling, reads[0] - before))

    engine._step = counted_step
    long_prompt = tok(" ".join(PROMPTS * 4))["input_ids"]
    stream_prompt = tok("Hello")["input_ids"]
    engine.start()
    try:
        started = queue.Queue()
        stream = engine.submit(GenerationRequest(prompt_ids=stream_prompt, max_new_tokens=80), started.put)
        assert isinstance(started.get(timeout=60), TokenEvent)
        results = _run(engine, [GenerationRequest(prompt_ids=long_prompt, max_new_tokens=3)])
        stream.cancel()
    finally:
        engine.stop()
    mixed = [it for it in iterations if it[0] and it[1]]
    assert len(mixed) >= len(long_prompt) // 8 - 1  # the long prompt took that many iterations, each next to a decode
    assert all(it[2] == 1 for it in mixed), mixed
    assert all(it[2] <= 1 for it in iterations), iterations
    got = [e.id for e in results[0] if isinstance(e, TokenEvent)]
    assert got == _greedy(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval(), long_prompt, 3)


def test_prompt_logprobs_come_from_the_chunked_prefill_itself(tiny_llama: Path, monkeypatch) -> None:
    """A prompt's own logprobs are scored from its prefill's logits, chunk after chunk (no second forward), and
    match plain transformers; such a prompt is prefilled whole even when the prefix cache holds it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok(" ".join(PROMPTS * 2))["input_ids"]
    assert len(prompt) > 3 * 8
    engine = Engine(model, tok, max_batch_size=2, max_queue=8, prefill_chunk=8)
    calls = [0]
    model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    engine.start()
    try:
        _run(engine, [GenerationRequest(prompt_ids=prompt, max_new_tokens=2)])  # the cache now holds the prompt
        before, forwards = engine.prefilled_tokens, calls[0]
        asked = GenerationRequest(prompt_ids=prompt, max_new_tokens=2, prompt_logprobs=True, top_n_tokens=3)
        final = _run(engine, [asked])[0][-1]
    finally:
        engine.stop()
    assert isinstance(final, FinishEvent)
    assert engine.prefilled_tokens - before == len(prompt)
    assert calls[0] - forwards == -(-len(prompt) // 8) + 1  # the prefill's chunks and one decode step, nothing more
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert [t.id for t in final.prefill] == prompt
    assert final.prefill[0].logprob is None
    for i, token in enumerate(final.prefill[1:], start=1):
        assert abs(token.logprob - float(want[i - 1, prompt[i]])) < 1e-4
        top = torch.topk(want[i - 1], 3)
        assert [t.id for t in token.top_tokens] == top.indices.tolist()
        assert all(abs(t.logprob - float(v)) < 1e-4 for t, v in zip(token.top_tokens, top.values))


def test_compute_starts_on_the_first_gpu_even_with_the_embeddings_on_the_host(tiny_llama: Path) -> None:
    """Issue 14 item 3: with the embeddings offloaded, the engine put token ids (and so logits and sampling) on the
    CPU, where the embedding weight lives. The device map's first GPU is where compute happens."""
    from service.engine.engine import input_device

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
    """Issue 14 item 7: ``empty_cache()`` ran inside the failure handler, while the exception (and the frames of the
    failed step, with their activations) still held the memory it was meant to give back. It now runs from the
    loop, after the step. (The slot KV cache is the engine's for its whole life, so it is not what is released.)"""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    handling_at_release: list[bool] = []

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    fault = _FailingForward(model, oom)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the engine's only CUDA question here
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: handling_at_release.append(sys.exc_info()[0] is not None))
    engine = Engine(model, tok, max_batch_size=2, max_queue=8)
    engine.start()
    try:
        prompts = [tok(p)["input_ids"] for p in ("Hello", "Rain fell")]
        fault.armed = True
        requests = [
            GenerationRequest(prompt_ids=ids, max_new_tokens=5, request_id=f"r{i}") for i, ids in enumerate(prompts)
        ]
        failed = _run(engine, requests)
        assert all(isinstance(events[-1], ErrorEvent) for events in failed)
        ok = _run(engine, [GenerationRequest(prompt_ids=prompts[0], max_new_tokens=3)])[0]
        assert isinstance(ok[-1], FinishEvent)
    finally:
        engine.stop()
    assert handling_at_release and not any(handling_at_release), "empty_cache ran while the exception was handled"


def test_an_engine_refuses_a_transformers_older_than_the_bound_it_needs(tiny_llama: Path, monkeypatch) -> None:
    """transformers < 5.24 swallows ``cache=`` and decodes without the KV cache (issue 34 defect 3): refused at
    once, with the version installed, the one needed and the pip command; the bound is pyproject's."""
    import re

    from service.engine import model_runner

    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert re.search(r'"transformers>=([\d.]+)', pyproject).group(1) == model_runner.MIN_TRANSFORMERS
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    monkeypatch.setattr(model_runner, "installed_transformers", lambda: "5.17.0")
    with pytest.raises(GenerationError, match=r"transformers 5\.17\.0 .*>= 5\.24.*pip install"):
        Engine(model, tok, max_batch_size=1)
    monkeypatch.setattr(model_runner, "installed_transformers", lambda: model_runner.MIN_TRANSFORMERS + ".0")
    Engine(model, tok, max_batch_size=1).stop()
