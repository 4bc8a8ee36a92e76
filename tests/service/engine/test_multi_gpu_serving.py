"""``loadmaster serve`` through the device pipeline, on stand-in devices: a real uvicorn server whose tiny Llama's
decoder layers are split into 2 or 3 runs (test-only ``standin_device_runs``: every run computes on the CPU) serves
16 concurrent greedy requests (decode rows next to prefill chunks, one asking for its prompt's logprobs) with the
tokens of the plain one-process server and of plain transformers' ``generate``; ``/info`` and ``/metrics`` say the
pipeline is on, over how many runs and micro-batches; and ``--micro-batches`` on a plan that does not span GPUs is
refused by name, not ignored."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import LiveServer, metric_samples, settings_for
from tests.service.http.test_concurrency import PROMPTS, _post_all


@pytest.fixture(scope="module", params=[2, 3], ids=["2-runs", "3-runs"])
def piped(request, tiny_llama: Path) -> Iterator[LiveServer]:
    s = LiveServer(
        settings_for(tiny_llama, max_batch_size=16, max_concurrent_requests=32, standin_device_runs=request.param)
    ).start()
    yield s
    s.stop()


def _bodies() -> list[dict]:
    return [
        {
            "inputs": p,
            "parameters": {"max_new_tokens": 8 + (i % 4) * 4, "details": True, "decoder_input_details": i == 5},
        }
        for i, p in enumerate(PROMPTS)
    ]


def test_sixteen_concurrent_greedy_requests_equal_the_plain_server_and_generate(
    piped: LiveServer, server: LiveServer, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy, _ = reference
    bodies = _bodies()
    engine = piped.runtime.engine
    report = engine.device_pipeline
    assert report.active and report.standin and report.runs == piped.settings.standin_device_runs
    before = engine.runner.steps
    packed: list[bool] = []  # each micro-batch call: packed (rows of different widths) or batched
    prepare = engine.runner.plain.prepare

    def spy(rows):
        calls = prepare(rows)
        packed.extend(c.packed for c in calls)
        return calls

    monkeypatch.setattr(engine.runner.plain, "prepare", spy)
    got = asyncio.run(_post_all(piped.url, bodies))
    want = asyncio.run(_post_all(server.url, bodies))
    assert all(r.status_code == 200 for r in got + want), [r.text for r in got if r.status_code != 200]
    for body, g, w in zip(bodies, (r.json() for r in got), (r.json() for r in want)):
        ids = [t["id"] for t in g["details"]["tokens"]]
        assert ids == [t["id"] for t in w["details"]["tokens"]], body["inputs"]
        assert ids == greedy(body["inputs"], body["parameters"]["max_new_tokens"]), body["inputs"]
        assert g["generated_text"] == w["generated_text"]
        for a, b in zip(g["details"]["tokens"], w["details"]["tokens"]):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        if body["parameters"]["decoder_input_details"]:
            pre_g, pre_w = g["details"]["prefill"], w["details"]["prefill"]
            assert [t["id"] for t in pre_g] == [t["id"] for t in pre_w] and len(pre_g) > 1
            for a, b in zip(pre_g[1:], pre_w[1:]):
                assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert engine.runner.steps > before
    assert engine.peak_batch > 4, "the 16 requests were not batched together"
    assert engine.runner.micro_batches_run > engine.runner.steps - before, "no step was split into micro-batches"
    assert True in packed and False in packed, "both packed and batched micro-batches ran through the pipeline"


def test_info_and_metrics_say_the_device_pipeline_is_on(piped: LiveServer, server: LiveServer) -> None:
    runs = piped.settings.standin_device_runs
    info = httpx.get(piped.url + "/info", timeout=30).json()["device_pipeline"]
    assert info["active"] and info["standin"] and info["runs"] == runs and info["micro_batches"] == 2 * runs
    assert len(info["devices"]) == runs and info["layers"][0][0] == 0 and "stand-in" in info["reason"]
    samples = metric_samples(httpx.get(piped.url + "/metrics", timeout=30).text)
    assert samples["loadmaster_device_pipeline_runs"] == runs
    assert samples["loadmaster_device_pipeline_micro_batches"] == 2 * runs
    plain = httpx.get(server.url + "/info", timeout=30).json()["device_pipeline"]
    assert not plain["active"] and plain["runs"] == 0 and "every decoder layer is on cpu" in plain["reason"]
    assert metric_samples(httpx.get(server.url + "/metrics", timeout=30).text)["loadmaster_device_pipeline_runs"] == 0


def test_micro_batches_is_honoured_with_runs_and_refused_by_name_without(tiny_llama: Path) -> None:
    s = LiveServer(settings_for(tiny_llama, standin_device_runs=2, micro_batches=3)).start()
    try:
        assert httpx.get(s.url + "/info", timeout=30).json()["device_pipeline"]["micro_batches"] == 3
        r = httpx.post(s.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
        assert r.status_code == 200
    finally:
        s.stop()
    s = LiveServer(settings_for(tiny_llama, micro_batches=2))
    try:
        with pytest.raises(RuntimeError, match="model failed to load") as failed:
            s.start()
        assert "--micro-batches 2 (LOADMASTER_MICRO_BATCHES)" in str(failed.value)
        assert "device pipeline is off" in str(failed.value)
    finally:
        s.stop()


@pytest.mark.parametrize(
    "flags", [{"dtype": "bfloat16"}, {"cpu_quantization": "int8"}], ids=["bf16", "int8-cpu-layers"]
)
def test_precision_and_quantization_flags_are_honoured_through_the_pipeline(tiny_llama: Path, flags: dict) -> None:
    """bf16 (decode rows and packed prompt rows in calls of their own) and int8 CPU layers: the
    pipelined server answers 8 concurrent requests with the tokens of a plain server given the same flags."""
    bodies = [{"inputs": p, "parameters": {"max_new_tokens": 8, "details": True}} for p in PROMPTS[:8]]
    answers = []
    for runs in (None, 2):
        s = LiveServer(settings_for(tiny_llama, max_batch_size=8, standin_device_runs=runs, **flags)).start()
        try:
            assert s.runtime.engine.device_pipeline.active == (runs is not None)
            rs = asyncio.run(_post_all(s.url, bodies))
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            answers.append([[t["id"] for t in r.json()["details"]["tokens"]] for r in rs])
        finally:
            s.stop()
    assert answers[0] == answers[1]


def test_stand_in_runs_are_refused_next_to_pipeline() -> None:
    with pytest.raises(ValueError, match=r"standin_device_runs .* unset it to serve with --pipeline"):
        settings_for(Path("."), standin_device_runs=2, pipeline=True)
