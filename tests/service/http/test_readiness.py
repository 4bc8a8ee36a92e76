"""The server listens before the model is loaded: readiness is 503 with progress, generation is refused."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from loaders import LoadProgress
from service.model.background_load import load_model
from tests.service.conftest import LiveServer, settings_for


def test_ready_reports_progress_until_the_load_finishes(tiny_llama: Path) -> None:
    release = threading.Event()
    reached = threading.Event()

    def held_load(settings, progress):
        """The real load, held half way: progress is reported, then it waits for the test."""
        progress(LoadProgress(bytes_done=500, bytes_total=1000, phase="loading"))
        reached.set()
        release.wait(30)
        return load_model(settings, progress)

    server = LiveServer(settings_for(tiny_llama), loader=held_load).start(wait_ready=False)
    try:
        assert reached.wait(30)
        assert httpx.get(server.url + "/health").status_code == 200
        r = httpx.get(server.url + "/health/ready")
        assert r.status_code == 503
        assert r.json()["status"] == "loading" and r.json()["progress"] == 0.5
        assert r.json()["bytes_done"] == 500 and r.json()["bytes_total"] == 1000

        g = httpx.post(server.url + "/generate", json={"inputs": "Hi"})
        assert g.status_code == 503 and g.json()["error_type"] == "not_ready"
        assert "loading" in g.json()["error"]
        o = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"})
        assert o.status_code == 503 and o.json()["error"]["type"] == "service_unavailable_error"
        assert httpx.get(server.url + "/info").json()["model_id"] is None
        assert httpx.get(server.url + "/v1/models").json()["data"] == []

        release.set()
        server.wait_ready(30)
        r = httpx.get(server.url + "/health/ready")
        assert r.status_code == 200 and r.json()["status"] == "ready" and r.json()["progress"] == 1.0
        assert (
            httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code
            == 200
        )
    finally:
        release.set()
        server.stop()


def test_failed_load_is_reported_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer
    server = LiveServer(settings_for(tmp_path)).start(wait_ready=False)
    try:
        for _ in range(600):
            r = httpx.get(server.url + "/health/ready")
            if r.json()["status"] == "failed":
                break
            threading.Event().wait(0.05)
        assert r.status_code == 503 and r.json()["status"] == "failed" and r.json()["error"]
        g = httpx.post(server.url + "/generate", json={"inputs": "Hi"})
        assert g.status_code == 503 and "failed to load" in g.json()["error"]
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
