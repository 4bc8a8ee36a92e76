"""GET /info, /metrics and /docs on the main server, and generation errors reaching clients over HTTP."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch

from tests.service.conftest import LiveServer, metric_samples, settings_for
from tests.service.engine.test_engine import _FailingForward, allocate_a_pebibyte


def test_info_reports_model_plan_device_map_memory_limits(client: httpx.Client, tiny_llama: Path) -> None:
    info = client.get("/info").json()
    assert info["model_id"] == "tiny-llama" and info["architecture"] == "LlamaForCausalLM"
    assert info["dtype"] == "float32" and info["quantization"] is None
    assert info["device_map"] == {"": "cpu"} and info["plan"]["device_map"] == {"": "cpu"}
    cpu = info["memory"]["cpu"]
    assert cpu["planned"]["weights"] == info["plan"]["budgets"][0]["weights"]
    weights = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))
    assert 0.9 * weights <= cpu["measured"]["weights"] <= weights  # parameters + buffers actually in RAM
    assert info["limits"]["max_batch_size"] == 16 and info["limits"]["max_total_tokens"] == 512
    assert info["prefix_cache"] is True
    assert info["version"] and info["status"]["status"] == "ready"
    assert info["load_stats"]["seconds"] >= 0
    from loaders.native import kernel_build

    fp32 = kernel_build.status(torch.float32)
    assert info["cpu_kernels"]["choice"] == "auto"
    assert info["cpu_kernels"]["kernels"]["float32"] == {"available": fp32.available, "reason": fp32.reason}
    threads = info["cpu_threads"]  # the ceiling from the affinity mask and cgroup quota, and why
    assert 1 <= threads["threads"] <= threads["ceiling"] <= threads["affinity"]
    assert threads["bound"] in ("affinity", "quota") and threads["adaptive"] and threads["reason"]
    assert threads["prefill_tokens"] >= 1
    assert threads["trying"] in (True, False)  # the governor's try state, through /info's response model
    assert threads["last_trial"] is None or set(threads["last_trial"]) >= {"from_threads", "to_threads", "kept"}
    assert (info["load_stats"]["native_linears"] > 0) == fp32.available


def test_metrics_count_requests_tokens_and_memory(client: httpx.Client) -> None:
    before = metric_samples(client.get("/metrics").text)
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 200
    client.post("/generate", json={"inputs": ""})  # a 422
    resp = client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    for line in text.splitlines():  # every sample line is `name{labels} number`
        if line and not line.startswith("#"):
            assert re.fullmatch(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+', line), line
    after = metric_samples(text)
    key_ok = 'loadmaster_requests_total{route="/generate",status="200"}'
    key_bad = 'loadmaster_requests_total{route="/generate",status="422"}'
    assert after[key_ok] == before.get(key_ok, 0) + 1
    assert after[key_bad] == before.get(key_bad, 0) + 1
    assert after["loadmaster_generated_tokens_total"] == before["loadmaster_generated_tokens_total"] + 5
    assert after["loadmaster_prompt_tokens_total"] > before["loadmaster_prompt_tokens_total"]
    assert (
        after["loadmaster_time_to_first_token_seconds_count"]
        == before["loadmaster_time_to_first_token_seconds_count"] + 1
    )
    assert after["loadmaster_queue_duration_seconds_count"] >= 1
    assert after['loadmaster_request_duration_seconds_count{route="/generate"}'] >= 2
    assert after["loadmaster_generated_tokens_per_second"] > 0
    assert "loadmaster_batch_size" in after and "loadmaster_queue_length" in after
    assert after['loadmaster_memory_bytes{device="cpu",kind="planned"}'] > 0
    assert after['loadmaster_memory_bytes{device="cpu",kind="measured"}'] > 0


def test_openapi_docs_list_every_route(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path in (
        "/generate",
        "/generate_stream",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/plan",
        "/info",
        "/health",
        "/health/ready",
        "/metrics",
    ):
        assert path in spec["paths"], path
    assert client.get("/docs").status_code == 200


@pytest.fixture(scope="module")
def faulty(tiny_gpt2: Path):
    s = LiveServer(settings_for(tiny_gpt2)).start()
    fault = _FailingForward(s.runtime.loaded.model, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    yield s, fault
    s.stop()


def test_out_of_memory_fails_the_request_cleanly_and_the_server_keeps_serving(faulty) -> None:
    server, fault = faulty
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
    fault.armed = True
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 500
    assert r.json()["error_type"] == "generation" and "Out of memory" in r.json()["error"]
    assert "Traceback" not in r.text

    fault.armed = True
    with httpx.stream("POST", server.url + "/generate_stream", json=body) as s:
        events = [json.loads(b[len("data:") :]) for b in s.read().decode().split("\n\n") if b.strip()]
    assert events[-1]["error_type"] == "generation" and "Out of memory" in events[-1]["error"]

    fault.armed = True
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"

    assert httpx.post(server.url + "/generate", json=body).status_code == 200
    assert server.runtime.in_flight == 0

    # The CPU's own out-of-memory: torch's allocator really refusing, mid-decode.
    fault.exc, fault.armed = allocate_a_pebibyte, True
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 500 and "Out of memory" in r.json()["error"] and "Traceback" not in r.text
    assert httpx.post(server.url + "/generate", json=body).status_code == 200
    assert server.runtime.in_flight == 0


DISK_MAP = {"": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}


@pytest.fixture(scope="module")
def half_on_disk(tiny_llama: Path, tmp_path_factory):
    settings = settings_for(
        tiny_llama,
        max_memory=["cpu=4GiB", "disk=1GiB"],
        strategy=json.dumps(DISK_MAP),
        offload_folder=str(tmp_path_factory.mktemp("offload")),
    )
    s = LiveServer(settings).start()
    yield s
    s.stop()


def test_disk_offloaded_weights_are_reported_under_disk(half_on_disk, tiny_llama: Path) -> None:
    """Disk tensors are memory maps that torch calls CPU tensors; /info and /metrics must still say disk."""
    from planner.model.safetensors_header import read_checkpoint_headers

    stored = read_checkpoint_headers(tiny_llama).tensors
    on_disk = sum(t.nbytes for k, t in stored.items() if k.startswith(("model.layers.1.", "model.layers.2.")))
    total = sum(t.nbytes for t in stored.values())
    assert 0 < on_disk < total
    r = httpx.post(half_on_disk.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200
    info = httpx.get(half_on_disk.url + "/info").json()
    assert {k for k, v in info["device_map"].items() if v == "disk"} == {"model.layers.1", "model.layers.2"}
    memory = info["memory"]
    assert memory["disk"]["measured"]["weights"] == on_disk == memory["disk"]["planned"]["weights"]
    assert memory["cpu"]["measured"]["weights"] == total - on_disk
    gauges = metric_samples(httpx.get(half_on_disk.url + "/metrics").text)
    assert gauges['loadmaster_memory_bytes{device="disk",kind="measured"}'] == on_disk
    assert gauges['loadmaster_memory_bytes{device="cpu",kind="measured"}'] == total - on_disk


def test_serve_builds_the_meta_model_once(tiny_gpt2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve describes the checkpoint once: the planner plans from that Skeleton and the loader fills its model."""
    import planner.model.skeleton as skeleton

    builds = []
    real = skeleton.build_meta_model
    monkeypatch.setattr(skeleton, "build_meta_model", lambda *a, **kw: builds.append(a) or real(*a, **kw))
    server = LiveServer(settings_for(tiny_gpt2)).start()
    try:
        r = httpx.post(server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200
        assert len(builds) == 1
        assert server.runtime.loaded.plan.fingerprint == skeleton.skeleton_from_dir(tiny_gpt2).fingerprint
    finally:
        server.stop()
