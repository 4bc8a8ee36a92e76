"""Server-sent events through sse-starlette: exact framing, and keep-alive pings that no client trips over.

The server here pings every 10 ms, so every stream of a few dozen tokens carries ping comments between its events;
TGI's ``text-generation``, ``openai`` and huggingface_hub's ``InferenceClient`` must read such streams unchanged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import text_generation

from tests.service.conftest import LiveServer, settings_for

PING_S = 0.01
TOKENS = 24


@pytest.fixture(scope="module")
def pinging(tiny_llama: Path) -> Iterator[LiveServer]:
    s = LiveServer(settings_for(tiny_llama, sse_ping_interval=PING_S)).start()
    yield s
    s.stop()


@pytest.fixture()
def hf_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub refuses every request while HF_HUB_OFFLINE is set; ours go to 127.0.0.1 only."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


def _raw_stream(url: str, path: str, body: dict) -> tuple[httpx.Headers, bytes]:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return r.headers, r.read()


def _split(raw: bytes) -> tuple[list[str], list[str]]:
    """The ``data:`` payloads and the comment lines of a stream framed with ``\\n`` line ends."""
    assert b"\r" not in raw, "events are framed with \\n only, as the web page and the clients expect"
    assert raw.endswith(b"\n\n")
    data, comments = [], []
    for block in raw.decode("utf-8").split("\n\n")[:-1]:
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line)
            else:
                assert line.startswith("data: "), line
                data.append(line[len("data: ") :])
    return data, comments


def _stream_with_pings(url: str, path: str, body: dict) -> tuple[httpx.Headers, list[str], list[str]]:
    """A stream long enough to carry pings: a loaded machine takes longer than 10 ms, a fast one may not, so the
    request is repeated with more tokens (at most four times) until a ping shows up between its events."""
    for attempt in range(4):
        headers, raw = _raw_stream(url, path, {**body, **_more_tokens(path, TOKENS * 2**attempt)})
        data, comments = _split(raw)
        if comments:
            return headers, data, comments
    raise AssertionError(f"no ping comment in four streams with a {PING_S}s ping interval")


def _more_tokens(path: str, n: int) -> dict:
    return {"parameters": {"max_new_tokens": n}} if path == "/generate_stream" else {"max_tokens": n}


def test_tgi_stream_is_compact_json_events_with_ping_comments_between(pinging: LiveServer) -> None:
    headers, data, comments = _stream_with_pings(pinging.url, "/generate_stream", {"inputs": "Once upon a time"})
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert all(c.startswith(": ping") for c in comments)
    events = [json.loads(d) for d in data]
    # byte-compatible with the framing before the library: compact separators, one JSON object per event
    assert data == [json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in events]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["details"]["finish_reason"] in ("length", "eos_token")
    assert all(e["generated_text"] is None for e in events[:-1])


def test_openai_stream_ends_with_done_after_pings(pinging: LiveServer) -> None:
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "temperature": 0, "stream": True}
    _, data, _ = _stream_with_pings(pinging.url, "/v1/completions", body)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_tgi_client_reads_a_pinged_stream(pinging: LiveServer) -> None:
    client = text_generation.Client(pinging.url, timeout=120)
    whole = client.generate("Once upon a time", max_new_tokens=TOKENS)
    events = list(client.generate_stream("Once upon a time", max_new_tokens=TOKENS))
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert events[-1].generated_text == whole.generated_text

    async def run() -> list:
        aclient = text_generation.AsyncClient(pinging.url, timeout=120)
        return [e async for e in aclient.generate_stream("Once upon a time", max_new_tokens=TOKENS)]

    assert [e.token.id for e in asyncio.run(run())] == [t.id for t in whole.details.tokens]


def test_openai_client_reads_pinged_streams(pinging: LiveServer) -> None:
    oa = openai.OpenAI(base_url=pinging.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = oa.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=TOKENS, temperature=0)
    chunks = list(
        oa.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=TOKENS, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    text = oa.completions.create(model="tiny-llama", prompt="Hello", max_tokens=TOKENS, temperature=0).choices[0].text
    pieces = list(
        oa.completions.create(model="tiny-llama", prompt="Hello", max_tokens=TOKENS, temperature=0, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces) == text


def test_huggingface_hub_client_reads_pinged_streams(pinging: LiveServer, hf_local: None) -> None:
    from huggingface_hub import InferenceClient

    hf = InferenceClient(model=pinging.url)
    text = hf.text_generation("Hello there", max_new_tokens=TOKENS)
    assert "".join(hf.text_generation("Hello there", max_new_tokens=TOKENS, stream=True)) == text
    chat = InferenceClient(base_url=pinging.url)
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = chat.chat_completion(messages, max_tokens=TOKENS, temperature=0)
    chunks = list(chat.chat_completion(messages, max_tokens=TOKENS, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
