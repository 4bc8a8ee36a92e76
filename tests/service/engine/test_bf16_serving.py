"""A bf16 model served on the CPU: decode runs on the native kernel, and answers match transformers' in bf16."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loaders.native import kernel_build
from tests.service.conftest import LiveServer, settings_for

PROMPTS = [
    "The old lighthouse keeper climbed",
    "Once upon a time in a quiet village",
    "Hello there, my friend",
    "A river runs through the valley and",
    "Winter came early that year",
    "She opened the letter slowly",
]


@pytest.fixture(scope="module")
def bf16_server(tiny_llama: Path):
    s = LiveServer(settings_for(tiny_llama, dtype="bfloat16", max_batch_size=8, max_concurrent_requests=16)).start()
    yield s
    s.stop()


def test_info_says_whether_the_native_kernel_runs(bf16_server: LiveServer) -> None:
    info = httpx.get(bf16_server.url + "/info", timeout=30).json()
    assert info["dtype"] == "bfloat16"
    st = kernel_build.status(torch.bfloat16)
    assert info["cpu_kernels"]["kernels"]["bfloat16"] == {"available": st.available, "reason": st.reason}
    if st.available:
        assert info["load_stats"]["native_linears"] > 0
    else:
        assert info["load_stats"]["native_linears"] == 0


def test_greedy_answers_equal_transformers_bf16_alone_and_together(bf16_server: LiveServer, tiny_llama: Path) -> None:
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)

    def expected(prompt: str) -> list[int]:
        ids = tok(prompt, return_tensors="pt")
        out = ref.generate(**ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        return out[0, ids["input_ids"].shape[1] :].tolist()

    def ask(prompt: str) -> list[int]:
        r = httpx.post(
            bf16_server.url + "/generate",
            timeout=60,
            json={"inputs": prompt, "parameters": {"max_new_tokens": 10, "details": True}},
        )
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    alone = [ask(p) for p in PROMPTS]
    assert alone == [expected(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert together == alone
