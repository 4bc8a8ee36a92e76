"""``loadmaster serve --cpu-quantization``: a real server decodes with int8 CPU layers, reports them in /info, and
answers the same alone as in a batch (the quantized kernels' rows do not depend on their neighbours)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import LiveServer, settings_for

PROMPTS = [
    "The old lighthouse keeper climbed",
    "Once upon a time in a quiet village",
    "Hello there, my friend",
    "Winter came early that year",
]


@pytest.fixture(scope="module")
def int8_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    saved = tmp_path_factory.mktemp("cpu-quantized")
    s = LiveServer(
        settings_for(
            tiny_llama, dtype="bfloat16", max_batch_size=8, cpu_quantization="int8", cpu_quantized_dir=str(saved)
        )
    ).start()
    yield s, saved
    s.stop()


def test_info_reports_the_quantized_layers_and_the_saved_file(int8_server) -> None:
    server, saved = int8_server
    info = httpx.get(server.url + "/info", timeout=30).json()
    q = info["load_stats"]["cpu_quantization"]
    assert q["scheme"] == "int8" and q["layers"] > 0 and q["bytes_after"] < q["bytes_before"]
    assert q["file"] and Path(q["file"]).parent == saved and Path(q["file"]).is_file()


def test_greedy_answers_alone_equal_answers_together(int8_server) -> None:
    server, _ = int8_server

    def ask(prompt: str) -> list[int]:
        r = httpx.post(
            server.url + "/generate",
            timeout=60,
            json={"inputs": prompt, "parameters": {"max_new_tokens": 10, "details": True}},
        )
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    alone = [ask(p) for p in PROMPTS]
    assert all(len(a) == 10 for a in alone)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert together == alone
