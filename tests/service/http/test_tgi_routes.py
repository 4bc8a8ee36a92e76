"""TGI routes over a real socket: shapes, SSE streaming, details, stop sequences, and huggingface_hub's client."""

from __future__ import annotations

import json

import httpx
import pytest


def sse_events(text: str) -> list[dict]:
    """Parse a TGI event stream: ``data:{json}`` events separated by blank lines."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data:"), block
        events.append(json.loads(block[len("data:") :]))
    return events


def test_generate_matches_transformers_greedy(client: httpx.Client, reference) -> None:
    greedy, tok = reference
    prompt = "The old lighthouse keeper"
    r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [t["id"] for t in body["details"]["tokens"]]
    assert ids == greedy(prompt, 12)
    assert body["generated_text"] == tok.decode(ids, skip_special_tokens=True)
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 12 and d["seed"] is None
    assert all(t["logprob"] <= 0 for t in d["tokens"])
    assert r.headers["x-request-id"]


def test_generate_without_details_has_only_text(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200
    assert set(r.json()) == {"generated_text"}


def test_return_full_text_prepends_the_prompt(client: httpx.Client) -> None:
    plain = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}}).json()
    full = client.post(
        "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4, "return_full_text": True}}
    ).json()
    assert full["generated_text"] == "Hello" + plain["generated_text"]


def test_stream_events_match_the_non_streamed_answer(client: httpx.Client) -> None:
    req = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 10, "details": True}}
    whole = client.post("/generate", json=req).json()
    with client.stream("POST", "/generate_stream", json=req) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert len(events) == 10
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == whole["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 10 and last["details"]["input_length"] > 0


def test_only_a_stream_wakes_the_event_loop_per_token(client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-streamed answer waits for the final event alone: its tokens are counted on the engine side but never
    queued for the event loop (one wake-up per token would steal CPU from the decode loop); a stream gets each."""
    from service.engine.requests import TokenEvent
    from service.http.admission import EngineStream

    delivered: list[tuple[bool, str]] = []
    real = EngineStream.deliver

    def recording(self: EngineStream, event) -> None:
        delivered.append((self.tokens, type(event).__name__))
        real(self, event)

    monkeypatch.setattr(EngineStream, "deliver", recording)
    params = {"max_new_tokens": 6, "details": True}
    r = client.post("/generate", json={"inputs": "Hello there", "parameters": params})
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 6
    assert delivered == [(False, "FinishEvent")]
    delivered.clear()
    r = client.post("/generate_stream", json={"inputs": "Hello there", "parameters": params})
    assert r.status_code == 200
    assert [name for _, name in delivered] == [TokenEvent.__name__] * 6 + ["FinishEvent"]
    assert all(tokens for tokens, _ in delivered)


def test_stop_sequence_ends_generation(client: httpx.Client) -> None:
    base = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 12}}).json()
    text = base["generated_text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2].strip() or text[-1]
    r = client.post(
        "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 12, "stop": [stop], "details": True}}
    ).json()
    assert r["details"]["finish_reason"] == "stop_sequence"
    assert r["generated_text"].endswith(stop)
    assert r["generated_text"] == text[: text.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible_and_reported(client: httpx.Client) -> None:
    params = {
        "max_new_tokens": 8,
        "do_sample": True,
        "temperature": 1.5,
        "top_k": 50,
        "top_p": 0.95,
        "typical_p": 0.99,
        "repetition_penalty": 1.2,
        "seed": 1234,
        "details": True,
    }
    a = client.post("/generate", json={"inputs": "Hello", "parameters": params}).json()
    b = client.post("/generate", json={"inputs": "Hello", "parameters": params}).json()
    assert a["details"]["tokens"] == b["details"]["tokens"]
    assert a["details"]["seed"] == 1234
    unseeded = dict(params, seed=None)
    c = client.post("/generate", json={"inputs": "Hello", "parameters": unseeded}).json()
    assert isinstance(c["details"]["seed"], int)  # the seed actually used is reported


def test_top_k_one_is_greedy(client: httpx.Client) -> None:
    greedy = client.post("/generate", json={"inputs": "Far away", "parameters": {"max_new_tokens": 8}}).json()
    k1 = client.post(
        "/generate",
        json={"inputs": "Far away", "parameters": {"max_new_tokens": 8, "do_sample": True, "top_k": 1, "seed": 7}},
    ).json()
    assert k1["generated_text"] == greedy["generated_text"]


def test_root_route_dispatches_like_tgi(client: httpx.Client) -> None:
    r = client.post("/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200 and isinstance(r.json(), list) and "generated_text" in r.json()[0]
    with client.stream("POST", "/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}, "stream": True}) as s:
        events = sse_events(s.read().decode())
    assert len(events) == 3 and events[-1]["details"]["finish_reason"] == "length"


@pytest.fixture()
def hf_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub refuses every request while HF_HUB_OFFLINE is set; ours go to 127.0.0.1 only."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


def test_huggingface_hub_client_works_unchanged(server, hf_local) -> None:
    from huggingface_hub import InferenceClient

    hf = InferenceClient(model=server.url)
    text = hf.text_generation("Hello there", max_new_tokens=6)
    detailed = hf.text_generation("Hello there", max_new_tokens=6, details=True)
    assert text == detailed.generated_text
    assert detailed.details.generated_tokens == 6 and detailed.details.finish_reason == "length"
    pieces = list(hf.text_generation("Hello there", max_new_tokens=6, stream=True))
    assert "".join(pieces) == text
    streamed = list(hf.text_generation("Hello there", max_new_tokens=6, stream=True, details=True))
    assert streamed[-1].generated_text == text and streamed[-1].details.finish_reason == "length"


def test_huggingface_hub_client_sees_validation_errors(server, hf_local) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError, ValidationError

    hf = InferenceClient(model=server.url)
    with pytest.raises((ValidationError, HfHubHTTPError)) as info:
        hf.text_generation("Hello", max_new_tokens=100000)
    assert "max_total_tokens" in str(info.value)


def test_huggingface_hub_chat_completion_against_v1(server, hf_local) -> None:
    from huggingface_hub import InferenceClient

    hf = InferenceClient(base_url=server.url)
    messages = [{"role": "user", "content": "Tell me a story."}]
    out = hf.chat_completion(messages, max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    chunks = list(hf.chat_completion(messages, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
