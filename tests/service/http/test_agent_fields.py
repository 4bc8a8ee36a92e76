"""The conformance lines of issue 37 on the main server: what guidellm, lm-eval, LangChain and the openai client
send (ignore_eos on completions and responses, continuous usage, stop_token_ids, logit_bias, cumulative text_offset,
echo with stream, k+1 top_logprobs, OpenAI error types, model names)."""

from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest

from tests.service.conftest import LiveServer, metric_samples, settings_for


@pytest.fixture()
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _sse(client: httpx.Client, route: str, body: dict) -> list[dict]:
    with client.stream("POST", route, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_ignore_eos_and_continuous_usage_as_guidellm_sends_them(client: httpx.Client) -> None:
    body = {
        "model": "tiny-llama",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _sse(client, "/v1/completions", body)
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counted == sorted(counted) and counted[-1] == 12 and all("usage" in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_responses_body_as_guidellm_sends_it(client: httpx.Client) -> None:
    """guidellm's ``/v1/responses`` request format: input_text parts, ``stop: null`` and vLLM's ``ignore_eos`` for a
    fixed-length run, streamed; it reads the output tokens from the usage of the terminal event (at the token limit
    ``response.incomplete``, as OpenAI sends it)."""
    body = {
        "model": "tiny-llama",
        "stream": True,
        "max_output_tokens": 9,
        "stop": None,
        "ignore_eos": True,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}],
    }
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["usage"]["output_tokens"] == 9
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == last["response"]["output"][0]["content"][0]["text"]


def _cancelled_total(client: httpx.Client) -> float:
    return metric_samples(client.get("/metrics").text)["loadmaster_cancelled_requests_total"]


def test_streams_read_to_their_end_are_not_counted_as_cancelled(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """guidellm reads a Responses stream to its terminal event and closes: that answer is whole (200 in the access
    log), not a client that left (499, loadmaster_cancelled_requests_total), and its slot is free at once."""
    before = _cancelled_total(client)
    user = [{"role": "user", "content": "Once upon a time"}]
    bodies = {
        "/v1/responses": {"model": "tiny-llama", "stream": True, "max_output_tokens": 5, "input": "Once upon a time"},
        "/v1/messages": {"model": "tiny-llama", "stream": True, "max_tokens": 5, "messages": user},
        "/v1/chat/completions": {"model": "tiny-llama", "stream": True, "max_tokens": 5, "messages": user},
    }
    with caplog.at_level(logging.INFO, logger="loadmaster.access"):
        for i, (route, body) in enumerate(bodies.items()):
            with client.stream("POST", route, json=body, headers={"x-request-id": f"whole-{i}"}) as r:
                assert r.status_code == 200, r.read()
                lines = list(r.iter_lines())  # to the end, as guidellm reads
            assert any(line.startswith("data: ") for line in lines)
        time.sleep(0.3)  # an abandoned generator is finalized on a later turn of the server's loop
    logged = {
        x["id"]: x["status"]
        for x in (json.loads(r.getMessage()) for r in caplog.records if r.name == "loadmaster.access")
    }
    assert [logged.get(f"whole-{i}") for i in range(len(bodies))] == [200] * len(bodies), logged
    samples = metric_samples(client.get("/metrics").text)
    assert samples["loadmaster_requests_in_flight"] == 0
    assert _cancelled_total(client) == before


def test_stop_token_ids_end_the_sequence(client: httpx.Client) -> None:
    plain = client.post(
        "/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 6, "details": True}}
    ).json()
    ids = [t["id"] for t in plain["details"]["tokens"]]
    stop_at = next(i for i, t in enumerate(ids) if t not in ids[:i])  # its first occurrence ends the sequence
    third = ids[max(stop_at, 2)] if ids[max(stop_at, 2)] not in ids[: max(stop_at, 2)] else ids[stop_at]
    body = {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    r = client.post("/v1/completions", json={**body, "stop_token_ids": [third]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == ids.index(third) + 1


def test_logit_bias_minus_100_removes_the_greedy_token(oa, client: httpx.Client) -> None:
    plain = client.post(
        "/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 1, "details": True}}
    ).json()
    greedy_id = plain["details"]["tokens"][0]["id"]
    body = {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 1, "temperature": 0, "logprobs": 0}
    biased = client.post("/v1/completions", json={**body, "logit_bias": {str(greedy_id): -100}}).json()
    plain_text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert biased["choices"][0]["text"] != plain_text


def test_streamed_text_offsets_are_cumulative_and_echo_streams_the_prompt_first(client: httpx.Client) -> None:
    body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = _sse(client, "/v1/completions", {**body, "stream": True})
    text = "".join(c["choices"][0]["text"] for c in chunks)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert text == whole["text"] and text.startswith("Hello")
    assert offsets == whole["logprobs"]["text_offset"]
    assert chunks[0]["choices"][0]["text"].startswith("Hello")


def test_top_logprobs_hold_the_sampled_token_k_plus_1(client: httpx.Client) -> None:
    body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 1.5, "seed": 3}
    zero = client.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert all(list(top) == [tok] for tok, top in zip(zero["tokens"], zero["top_logprobs"]))
    two = client.post("/v1/completions", json={**body, "logprobs": 2}).json()["choices"][0]["logprobs"]
    for tok, top in zip(two["tokens"], two["top_logprobs"]):
        assert tok in top and len(top) in (2, 3)


def test_echo_of_token_ids_with_bos_indexes_its_text(client: httpx.Client) -> None:
    ids = client.post("/tokenize", json={"inputs": "Quecmp"}).json()
    body = {"model": "tiny-llama", "prompt": [t["id"] for t in ids], "max_tokens": 1, "echo": True, "logprobs": 0}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "".join(lp["tokens"])
    assert all(choice["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))


def test_v1_errors_carry_openai_types(client: httpx.Client) -> None:
    r = client.get("/v1/embeddings")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.post("/v1/completions", json={"prompt": "x", "min_p": 2})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_aliases_and_accept_any_model(tiny_llama) -> None:
    server = LiveServer(settings_for(tiny_llama, served_model_name="main-name,other-name")).start()
    try:
        for name in ("main-name", "other-name"):
            r = httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "main-name"
        r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        server.stop()
    server = LiveServer(settings_for(tiny_llama, accept_any_model=True)).start()
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    finally:
        server.stop()


def test_user_reasoning_effort_and_service_tier(client: httpx.Client) -> None:
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    ok = client.post("/v1/chat/completions", json={**chat, "user": "u-1", "service_tier": "auto"})
    assert ok.status_code == 200
    effort = client.post("/v1/chat/completions", json={**chat, "reasoning_effort": "low"})
    assert effort.status_code == 200
    tier = client.post("/v1/chat/completions", json={**chat, "service_tier": "priority"})
    assert tier.status_code == 400 and "service_tier" in tier.json()["error"]["message"]
