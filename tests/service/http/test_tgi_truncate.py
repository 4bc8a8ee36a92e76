"""TGI's ``truncate`` as TGI defines it (issue 38): the input is tokenized, its last ``truncate`` tokens are kept,
and only then is ``max_input_tokens`` checked; ``truncate`` itself must be in [1, max_input_tokens]."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def long_text() -> str:
    return " ".join(f"w{i % 97}" for i in range(700))


def test_a_long_input_is_truncated_to_its_last_tokens_then_served(client: httpx.Client, server, long_text: str) -> None:
    tok = AutoTokenizer.from_pretrained(server.settings.model)
    ids = tok(long_text)["input_ids"]
    assert len(ids) > 2 * server.settings.max_input_tokens  # far over the limit without truncate
    r = client.post("/generate", json={"inputs": long_text, "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 422 and "max_input_tokens" in r.json()["error"]
    for route in ("/generate", "/"):
        body = {
            "inputs": long_text,
            "parameters": {"truncate": 100, "max_new_tokens": 3, "decoder_input_details": True, "details": True},
        }
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        answer = r.json()[0] if isinstance(r.json(), list) else r.json()
        assert [t["id"] for t in answer["details"]["prefill"]] == ids[-100:]
    # streaming too: the stream is served
    with client.stream("POST", "/generate_stream", json={"inputs": long_text, "parameters": {"truncate": 50}}) as r:
        assert r.status_code == 200 and "data:" in r.read().decode()


@pytest.mark.parametrize("truncate", [0, -1, 257, 10**6])
def test_truncate_outside_one_to_max_input_tokens_is_422(client: httpx.Client, truncate: int) -> None:
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"truncate": truncate}})
    assert r.status_code == 422 and "truncate" in r.json()["error"]


def test_truncate_longer_than_the_input_keeps_it_whole(client: httpx.Client, server) -> None:
    tok = AutoTokenizer.from_pretrained(server.settings.model)
    body = {
        "inputs": "Hello there",
        "parameters": {"truncate": 200, "max_new_tokens": 2, "decoder_input_details": True, "details": True},
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200
    assert [t["id"] for t in r.json()["details"]["prefill"]] == tok("Hello there")["input_ids"]
