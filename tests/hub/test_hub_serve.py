"""``loadmaster serve org/name``: fetch only what loading needs (with progress), resume, serve, then serve offline."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.hub.conftest import BIG, ROOT, TINY, hub_env
from tests.hub.fake_hub import FakeHub
from tests.service.conftest import free_port

SERVE_FLAGS = ["--max-memory", "cpu=4GiB", "--max-total-tokens", "256", "--max-batch-size", "2", "--threads", "1"]


class ServeProcess:
    """``loadmaster serve`` as a subprocess on a free port, its stderr collected in a file."""

    def __init__(self, model: str, env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", model, "--port", str(self.port), *SERVE_FLAGS],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(log, "w"),
        )

    def health(self) -> dict | None:
        try:
            return httpx.get(self.url + "/health/ready", timeout=5).json()
        except httpx.TransportError:
            return None

    def wait(self, until, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            h = self.health()
            if h is not None and h.get("status") == "failed":
                raise AssertionError(f"load failed: {h}")
            if h is not None and until(h):
                return h
            time.sleep(0.05)
        raise AssertionError(f"timed out; last health {self.health()}; log: {self.log.read_text()[-3000:]}")

    def generate(self, prompt: str, n: int = 8) -> list[int]:
        r = httpx.post(
            self.url + "/generate",
            json={"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture()
def greedy(tiny_llama: Path):
    """Plain transformers' greedy tokens on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)

    def run(prompt: str, n: int) -> list[int]:
        ids = tok(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        return out[0, ids["input_ids"].shape[1] :].tolist()

    return run


def test_serve_by_id_fetches_what_loading_needs_then_serves_offline(fake_hub: FakeHub, tmp_path: Path, greedy) -> None:
    hf_home = tmp_path / "hf"
    mark = fake_hub.mark()
    server = ServeProcess(TINY, hub_env(fake_hub.url, hf_home), tmp_path / "serve1.log")
    try:
        server.wait(lambda h: h["status"] == "ready")
        prompt = "The old lighthouse keeper"
        assert server.generate(prompt) == greedy(prompt, 8)
        info = httpx.get(server.url + "/info", timeout=10).json()
        assert TINY in str(info)
    finally:
        server.stop()
    fetched = {
        q.path.rsplit("/", 1)[1]
        for q in fake_hub.since(mark)
        if q.method == "GET" and "/resolve/" in q.path and q.status in (200, 206)
    }
    repo = fake_hub.repos[TINY]
    expected = {n for n in repo.files if n.endswith((".safetensors", ".json", ".jinja"))}
    assert fetched == expected, fetched ^ expected
    assert not {"pytorch_model.bin", "training_args.bin", "README.md"} & fetched
    log = (tmp_path / "serve1.log").read_text()
    assert f"downloading {TINY}:" in log and "/s" in log  # progress on the terminal: bytes and rate

    # second start: HF_HUB_OFFLINE=1 and nothing listening where the Hub was
    mark = fake_hub.mark()
    env = hub_env("http://127.0.0.1:9", hf_home, HF_HUB_OFFLINE="1")
    server = ServeProcess(TINY, env, tmp_path / "serve2.log")
    try:
        server.wait(lambda h: h["status"] == "ready")
        assert server.generate(prompt) == greedy(prompt, 8)
    finally:
        server.stop()
    assert not fake_hub.since(mark)


def _partial_files(hf_home: Path) -> list[Path]:
    return list(hf_home.glob("hub/*/blobs/*.loadmaster-partial"))


def test_an_interrupted_download_resumes_where_it_stopped(fake_hub: FakeHub, big_llama: Path, tmp_path: Path) -> None:
    """The first run is killed (SIGKILL) in the middle of a shard; the second asks only for the rest of it."""
    hf_home = tmp_path / "hf"
    shard = "model-00002-of-00004.safetensors"
    size = (big_llama / shard).stat().st_size
    stall = fake_hub.stall_next_get(BIG, shard, after=12 << 20)  # huggingface_hub writes in 10 MiB chunks
    first = ServeProcess(BIG, hub_env(fake_hub.url, hf_home, HF_HUB_DOWNLOAD_TIMEOUT="120"), tmp_path / "first.log")
    try:
        assert stall.reached.wait(180), (tmp_path / "first.log").read_text()[-3000:]
        h = first.wait(lambda h: h["status"] == "downloading" and h["bytes_done"] >= (10 << 20))
        assert h["bytes_total"] >= 200 * 10**6 and h["rate_bytes_per_s"] > 0
        deadline = time.monotonic() + 30
        while not _partial_files(hf_home) and time.monotonic() < deadline:
            time.sleep(0.05)
        first.stop(signal.SIGKILL)
    finally:
        stall.release.set()
        first.stop(signal.SIGKILL)
    partial = _partial_files(hf_home)
    assert len(partial) == 1
    kept = partial[0].stat().st_size
    assert 0 < kept < size

    mark = fake_hub.mark()
    second = ServeProcess(BIG, hub_env(fake_hub.url, hf_home), tmp_path / "second.log")
    try:
        second.wait(lambda h: h["status"] == "ready", timeout=400)
        assert len(second.generate("Hello", 2)) == 2
    finally:
        second.stop()
    gets = [q for q in fake_hub.since(mark) if q.method == "GET" and q.path.endswith("/" + shard)]
    assert [(q.range, q.status, q.sent) for q in gets] == [(f"bytes={kept}-", 206, size - kept)]
    first_shard = [
        q for q in fake_hub.since(mark) if q.method == "GET" and q.path.endswith("/model-00001-of-00004.safetensors")
    ]
    assert not first_shard  # finished in the first run: not fetched again
    assert not _partial_files(hf_home)
    cached = next(hf_home.glob(f"hub/*/snapshots/*/{shard}"))
    assert _sha256(cached) == _sha256(big_llama / shard)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
