"""Real uvicorn servers on free ports, serving the shared tiny models, for the service tests.

Servers run in a thread of the test process (so a test can reach the engine and the runtime) or, for signal
handling, as a subprocess (see test_shutdown.py). Each fixture is shared as widely as its settings allow.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.http.app import create_app
from service.http.connection_guard import guarded_protocol
from service.settings import ServiceSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_samples(text: str) -> dict[str, float]:
    """Every sample of a ``/metrics`` page, parsed by prometheus-client's own parser, keyed as it is written:
    ``name{label="value",...}`` (labels in page order), or the bare name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class LiveServer:
    """A uvicorn server on 127.0.0.1:<free port> in a background thread, with the app it serves."""

    def __init__(self, settings: ServiceSettings, loader: Any = None):
        self.port = free_port()
        self.settings = settings.model_copy(update={"port": self.port, "host": "127.0.0.1"})
        self.app = create_app(self.settings, loader=loader)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=2,
            http=guarded_protocol(self.settings.header_timeout, self.settings.body_timeout),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def runtime(self):
        return self.app.state.runtime

    def start(self, wait_ready: bool = True, timeout: float = 300.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(self.url + "/health/ready", timeout=5)
            if r.status_code == 200:
                return
            if r.json().get("status") == "failed":
                raise RuntimeError(f"model failed to load: {r.json()}")
            time.sleep(0.05)
        raise RuntimeError("server not ready in time")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def settings_for(model: Path, **kw: Any) -> ServiceSettings:
    base: dict[str, Any] = dict(
        model=str(model), max_memory=["cpu=4GiB"], max_total_tokens=512, max_input_tokens=256, default_max_new_tokens=16
    )
    base.update(kw)
    return ServiceSettings(**base)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_gpt2: Path) -> Path:
    """A model root holding links to two tiny models, plus a symlink that leads out of it."""
    root = tmp_path_factory.mktemp("models")
    (root / "llama").symlink_to(tiny_llama, target_is_directory=True)  # resolves outside: refused
    real = root / "gpt2-copy"
    real.mkdir()
    for f in tiny_gpt2.iterdir():
        if f.is_file():
            (real / f.name).write_bytes(f.read_bytes())
    outside = tmp_path_factory.mktemp("outside")
    (outside / "config.json").write_text((tiny_gpt2 / "config.json").read_text())
    (root / "escape").symlink_to(outside, target_is_directory=True)
    return root


@pytest.fixture(scope="session")
def server(tiny_llama: Path, model_root: Path) -> Iterator[LiveServer]:
    """The main server: tiny Llama, 16-wide batches, /plan roots, generous limits."""
    s = LiveServer(
        settings_for(
            tiny_llama, max_batch_size=16, max_concurrent_requests=32, model_root=[str(model_root)], max_body_bytes=4096
        )
    ).start()
    yield s
    s.stop()


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def reference(tiny_llama: Path):
    """Plain transformers' greedy tokens on the served weights, and the tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)

    def greedy(prompt: str, n: int) -> list[int]:
        ids = tok(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        return out[0, ids["input_ids"].shape[1] :].tolist()

    return greedy, tok
