"""Batching under load: equal greedy outputs alone or among 15 others, 429 past the limit, disconnects free slots."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.models import llama_100m_dir
from tests.service.conftest import LiveServer, settings_for

PROMPTS = [
    "Once upon a time",
    "The sea was calm",
    "Hello",
    "In the beginning the old king of the northern hills said",
    "A",
    "Rain fell on the roofs of the little town all night long and",
    "She opened the door",
    "Numbers: one two three four five",
    "The quick brown fox",
    "Why",
    "It was the best of times, it was the worst of times",
    "The lighthouse",
    "Far away, beyond the mountains and the rivers",
    "Tomorrow",
    "He said nothing and walked on",
    "Morning came",
]


async def _post_all(url: str, bodies: list[dict], route: str = "/generate") -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return await asyncio.gather(*(c.post(route, json=b) for b in bodies))


def test_sixteen_concurrent_clients_equal_sequential_greedy(server: LiveServer, client: httpx.Client) -> None:
    bodies = [
        {"inputs": p, "parameters": {"max_new_tokens": 12 + (i % 5) * 4, "details": True}}
        for i, p in enumerate(PROMPTS)
    ]
    sequential = []
    for b in bodies:
        r = client.post("/generate", json=b)
        assert r.status_code == 200
        sequential.append(r.json())
    engine = server.runtime.engine
    engine.peak_batch = 0
    concurrent = asyncio.run(_post_all(server.url, bodies))
    assert all(r.status_code == 200 for r in concurrent)
    for got, want in zip((r.json() for r in concurrent), sequential):
        assert got["generated_text"] == want["generated_text"]
        assert [t["id"] for t in got["details"]["tokens"]] == [t["id"] for t in want["details"]["tokens"]]
        assert got["details"]["finish_reason"] == want["details"]["finish_reason"]
        # logprobs come from batched float sums: equal to rounding, not bit for bit
        for a, b in zip(got["details"]["tokens"], want["details"]["tokens"]):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert engine.peak_batch > 4, "the 16 requests were not batched together"

    # streams join and leave the batch mid-way: still the same tokens
    async def streams() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:

            async def one(b: dict) -> str:
                async with c.stream("POST", "/generate_stream", json=b) as r:
                    return (await r.aread()).decode()

            return await asyncio.gather(*(one(b) for b in bodies))

    import json

    for raw, seq in zip(asyncio.run(streams()), sequential):
        events = [json.loads(e[len("data:") :]) for e in raw.split("\n\n") if e.strip()]
        assert [e["token"]["id"] for e in events] == [t["id"] for t in seq["details"]["tokens"]]


@pytest.fixture(scope="module")
def limited() -> Iterator[LiveServer]:
    """A server with room for 3 requests and 2 sequences per batch, on a model slow enough (~100M parameters)
    that a long stream is still running whenever the test looks."""
    s = LiveServer(
        settings_for(
            llama_100m_dir(), max_concurrent_requests=3, max_batch_size=2, max_total_tokens=1000, max_input_tokens=100
        )
    ).start()
    yield s
    s.stop()


async def _open_streams(url: str, n: int, max_new_tokens: int = 900):
    """Open ``n`` long streams; each holds a slot (headers are sent before its first token)."""
    client = httpx.AsyncClient(base_url=url, timeout=60)
    opened = []
    for _ in range(n):
        cm = client.stream(
            "POST", "/generate_stream", json={"inputs": "Hold", "parameters": {"max_new_tokens": max_new_tokens}}
        )
        r = await cm.__aenter__()
        assert r.status_code == 200
        opened.append((cm, r))
    return client, opened


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_requests_past_the_limit_get_429_and_freed_slots_are_reused(limited: LiveServer) -> None:
    async def scenario() -> None:
        client, opened = await _open_streams(limited.url, 3)
        try:
            assert limited.runtime.in_flight == 3
            async with httpx.AsyncClient(base_url=limited.url, timeout=30) as c:
                r = await c.post("/generate", json={"inputs": "x"})
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error_type"] == "overloaded"
                r = await c.post("/v1/completions", json={"prompt": "x"})
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"  # OpenAI's name for it
            # close a running stream and the queued one mid-way: their slots free at once, the next request runs
            for cm, _ in (opened.pop(), opened.pop(0)):
                await cm.__aexit__(None, None, None)
            assert _wait(lambda: limited.runtime.in_flight == 1)
            async with httpx.AsyncClient(base_url=limited.url, timeout=30) as c:
                r = await c.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
                assert r.status_code == 200
        finally:
            for cm, _ in opened:
                await cm.__aexit__(None, None, None)
            await client.aclose()

    asyncio.run(scenario())
    assert _wait(lambda: limited.runtime.in_flight == 0 and limited.runtime.engine.active == 0)


def test_burst_beyond_the_limit_never_5xx(limited: LiveServer) -> None:
    bodies = [{"inputs": p, "parameters": {"max_new_tokens": 20}} for p in PROMPTS[:12]]
    responses = asyncio.run(_post_all(limited.url, bodies))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 3 and codes.count(429) >= 1
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)


def test_disconnect_mid_stream_frees_the_batch_slot(limited: LiveServer) -> None:
    """With 2 batch slots both held by long streams, closing one lets a new request run right away."""
    engine = limited.runtime.engine

    async def scenario() -> float:
        client, opened = await _open_streams(limited.url, 2, max_new_tokens=900)
        try:
            assert _wait(lambda: engine.active == 2)
            cm, _ = opened.pop(0)
            await cm.__aexit__(None, None, None)  # client goes away
            assert _wait(lambda: engine.active == 1, timeout=5)
            started = time.monotonic()
            async with httpx.AsyncClient(base_url=limited.url, timeout=60) as c:
                r = await c.post(
                    "/generate", json={"inputs": "next", "parameters": {"max_new_tokens": 3, "details": True}}
                )
            assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 3
            # the remaining long stream is still running: the new request did not wait for it to end
            assert _wait(lambda: engine.active == 1, timeout=5) and limited.runtime.in_flight == 1
            return time.monotonic() - started
        finally:
            for cm, _ in opened:
                await cm.__aexit__(None, None, None)
            await client.aclose()

    asyncio.run(scenario())
    assert _wait(lambda: engine.active == 0 and limited.runtime.in_flight == 0)


def test_non_streaming_client_disconnect_cancels_its_sequence(limited: LiveServer) -> None:
    engine = limited.runtime.engine

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=limited.url, timeout=60) as c:
            task = asyncio.create_task(
                c.post("/generate", json={"inputs": "long", "parameters": {"max_new_tokens": 900}})
            )
            for _ in range(500):
                await asyncio.sleep(0.01)
                if engine.active == 1:
                    break
            assert engine.active == 1
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(scenario())
    assert _wait(lambda: engine.active == 0 and limited.runtime.in_flight == 0, timeout=5), (
        engine.active,
        limited.runtime.in_flight,
        engine.queue_length,
    )
