"""Files changing under a running server (issue 38): a weight shard truncated, removed, or rewritten in place with
the same size (as ``rsync --inplace`` does) makes the server stop admitting, answer 503 with the reason on the
readiness probe and on requests, and report the failure that makes ``loadmaster serve`` exit non-zero."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import LiveServer, settings_for


def _rewrite_in_place(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[-16:] = bytes(16)
    with shard.open("r+b") as f:
        f.write(data)
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10_000_000))  # a coarse clock still sees a new mtime


CHANGES = {
    "truncated": lambda shard: os.truncate(shard, shard.stat().st_size // 2),
    "removed": lambda shard: shard.unlink(),
    "rewritten in place": _rewrite_in_place,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_shard_stops_the_server_with_a_reason(tiny_llama: Path, tmp_path: Path, change: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    server = LiveServer(settings_for(model, weights_watch_interval=0.1))
    failed: list[str] = []
    server.runtime.host.on_failed(failed.append)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
            shard = sorted(model.glob("*.safetensors"))[0]
            CHANGES[change](shard)
            deadline = time.monotonic() + 10
            while c.get("/health/ready").status_code == 200:
                assert time.monotonic() < deadline, "the change was not noticed"
                time.sleep(0.05)
            ready = c.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "failed"
            assert shard.name in ready.json()["error"] and "changed on disk" in ready.json()["error"]
            r = c.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            assert r.status_code == 503 and shard.name in r.json()["error"]
            for _ in range(100):
                if failed:
                    break
                time.sleep(0.05)
            assert failed and shard.name in failed[0]  # what makes `loadmaster serve` exit 1
    finally:
        server.stop()


def test_unchanged_weights_keep_serving(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    server = LiveServer(settings_for(model, weights_watch_interval=0.05)).start()
    try:
        (model / "unrelated.txt").write_text("not a weight")
        os.utime(model / "config.json")
        time.sleep(0.5)
        assert httpx.get(server.url + "/health/ready", timeout=10).status_code == 200
    finally:
        server.stop()
