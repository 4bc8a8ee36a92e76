"""Files changing under a running server (issue 38): a weight shard truncated, removed, or rewritten in place with
the same size (as ``rsync --inplace`` does) makes the server stop admitting, answer 503 with the reason on the
readiness probe and on requests, and report the failure that makes ``loadmaster serve`` exit non-zero; and the same
while a stream is being generated, with the weights resident (private copies) or read in place (the disk tier,
whose maps :mod:`loaders.native.map_guard` guards): the stream ends with its answer or the reason, and the server,
which is this test's own process, never dies of SIGBUS."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
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


#: Layers read in place from the shards each step (the disk tier); the rest is resident (private copies).
DISK_MAP = {"": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
TIERS = {
    "resident": {},
    "disk tier": {"max_memory": ["cpu=4GiB", "disk=1GiB"], "strategy": json.dumps(DISK_MAP)},
}


def _stream_while(server: LiveServer, change: Callable[[], None]) -> tuple[list[dict], str | None]:
    """A long ``/generate_stream`` in flight; ``change`` runs once its first token has arrived. Returns the stream's
    events and, if the connection failed instead of ending, why (a server killed by a signal drops it)."""
    events: list[dict] = []
    started = threading.Event()
    dropped: list[str] = []

    def read() -> None:
        body = {"inputs": "Hold", "parameters": {"max_new_tokens": 400}}
        try:
            with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events.append(json.loads(line[len("data:") :]))
                        started.set()
        except httpx.HTTPError as exc:
            dropped.append(f"{type(exc).__name__}: {exc}")
        finally:
            started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(60)
    change()
    reader.join(60)
    assert not reader.is_alive(), "the stream never ended"
    return events, (dropped[0] if dropped else None)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_shard_changed_while_a_request_streams_ends_it_with_an_answer_or_an_error(
    tiny_llama: Path, tmp_path: Path, change: str, tier: str
) -> None:
    """Issue 38's acceptance: every shard truncated, removed or rewritten in place while a stream is being
    generated (resident weights, or layers read from the shards every step). The server is this test's own
    process: a SIGBUS would end the test run. The stream ends with its answer or with an error event that says
    why, never a dropped connection; readiness and new requests answer 503 with the reason; serve exits non-zero."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    settings = settings_for(model, weights_watch_interval=0.1, offload_folder=str(tmp_path / "off"), **TIERS[tier])
    server = LiveServer(settings)
    failed: list[str] = []
    server.runtime.host.on_failed(failed.append)
    server.start()
    try:
        shards = sorted(model.glob("*.safetensors"))
        events, dropped = _stream_while(server, lambda: [CHANGES[change](s) for s in shards])
        assert dropped is None, dropped
        last = events[-1]
        if "error" in last:
            assert "changed on disk" in last["error"] or "truncated" in last["error"], last
        else:
            assert last["generated_text"] is not None and last["details"]["generated_tokens"] >= 1
        with httpx.Client(base_url=server.url, timeout=30) as c:
            deadline = time.monotonic() + 10
            while c.get("/health/ready").status_code == 200:
                assert time.monotonic() < deadline, "the change was not noticed"
                time.sleep(0.05)
            ready = c.get("/health/ready").json()
            assert any(s.name in ready["error"] for s in shards), ready
            r = c.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            assert r.status_code == 503, r.text
        for _ in range(100):
            if failed:
                break
            time.sleep(0.05)
        assert failed and "changed on disk" in failed[0]
    finally:
        server.stop()


def test_a_truncated_disk_tier_fails_the_step_that_read_it(tiny_llama: Path, tmp_path: Path) -> None:
    """With the watch too slow to notice first, the step that reads past a truncated shard's end fails its stream
    with that reason (its tokens would come from zeros), the engine stops, and readiness answers 503."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    settings = settings_for(
        model, weights_watch_interval=600, offload_folder=str(tmp_path / "off"), **TIERS["disk tier"]
    )
    server = LiveServer(settings).start()
    try:
        shards = sorted(model.glob("*.safetensors"))
        events, dropped = _stream_while(server, lambda: [os.truncate(s, 0) for s in shards])
        assert dropped is None, dropped
        error = events[-1].get("error", "")
        assert "truncated while the server ran" in error and any(s.name in error for s in shards), events[-1]
        ready = httpx.get(server.url + "/health/ready", timeout=30)
        assert ready.status_code == 503 and "truncated" in ready.json()["error"], ready.text
        r = httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "truncated" in r.json()["error"], r.text
    finally:
        server.stop()
