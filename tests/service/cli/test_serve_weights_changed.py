"""Issue 38, end to end: ``loadmaster serve`` in its own process, its shards truncated while a stream is being
generated from layers read in place (the disk tier). The process answers (the stream ends with its tokens or with
an error that says why), goes unready with the reason, and exits with status 1 for its orchestrator to restart it:
never a death by SIGBUS (status -7) nor a dropped connection."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.service.cli.test_cli_serve import REPO, _env, _wait_ready
from tests.service.conftest import free_port

DISK_MAP = {"": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}


def test_serve_exits_1_with_the_reason_when_its_shards_are_truncated_mid_stream(tiny_llama: Path, tmp_path: Path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "service.cli", "serve", str(model), "--port", str(port)]
    argv += ["--strategy", json.dumps(DISK_MAP), "--max-memory", "cpu=4GiB,disk=1GiB"]
    argv += ["--offload-folder", str(tmp_path / "off"), "--weights-watch-interval", "0.2", "--max-total-tokens", "512"]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    try:
        _wait_ready(url, proc, log, timeout=180, poll=0.2)
        events: list[dict] = []
        body = {"inputs": "Hold", "parameters": {"max_new_tokens": 400}}
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(json.loads(line[len("data:") :]))
                if len(events) == 1:
                    for shard in model.glob("*.safetensors"):
                        os.truncate(shard, 0)
        last = events[-1]
        assert "error" in last or last.get("generated_text") is not None, last
        if "error" in last:
            assert "truncated" in last["error"] or "changed on disk" in last["error"], last
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                ready = httpx.get(url + "/health/ready", timeout=5)
                if ready.status_code == 503:
                    assert ".safetensors" in ready.json()["error"], ready.text
            except httpx.TransportError:
                pass  # it is exiting
            time.sleep(0.1)
        assert proc.wait(timeout=30) == 1, log.read_text()[-3000:]
        text = log.read_text()
        assert "changed on disk" in text and ".safetensors" in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
