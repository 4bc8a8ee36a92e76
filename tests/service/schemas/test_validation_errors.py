"""Every validation error path: 422 with the envelope on TGI routes, 400 in OpenAI's shape under /v1."""

from __future__ import annotations

import httpx
import pytest

BAD_PARAMETERS = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 0}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"typical_p": 2}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 10_000}, "max_total_tokens"),
    ({"max_new_tokens": "many"}, "max_new_tokens"),
    ({"do_sample": "perhaps"}, "do_sample"),
    ({"stop": "not-a-list"}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"best_of": 2}, "best_of"),  # greedy best_of; and never streamed
    ({"seed": -1}, "seed"),
    ({"watermark": True}, "watermark"),
    ({"adapter_id": "lora-1"}, "adapter_id"),
    ({"no_such_knob": 3}, "parameters.no_such_knob"),
    ({"top_n_tokens": 99}, "top_n_tokens"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"grammar": {"type": "json", "value": {"type": 5}}}, "parameters.grammar.value"),
    ({"grammar": {"type": "json", "value": "{not json"}}, "parameters.grammar.value"),
    ({"grammar": {"type": "yaml", "value": "a: b"}}, "grammar.type"),
    ({"grammar": {"type": "regex", "value": "(unclosed"}}, "regex"),
    # Values of the wrong JSON type are refused, never coerced (schemathesis' negative_data_rejection found
    # booleans read as token ids): the document's types are the ones accepted.
    ({"max_new_tokens": "4"}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"seed": "7"}, "seed"),
    ({"details": 1}, "details"),
    ({"stop": [1]}, "stop"),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("params,mentions", BAD_PARAMETERS)
def test_bad_parameters_are_422_before_any_stream(
    client: httpx.Client, route: str, params: dict, mentions: str
) -> None:
    r = client.post(route, json={"inputs": "Hello", "parameters": params})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/json")  # never an event stream
    body = r.json()
    assert body["error_type"] == "validation"
    assert mentions in body["error"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize(
    "payload,mentions",
    [
        ({"inputs": ""}, "empty"),
        ({"inputs": 123}, "inputs"),
        ({"parameters": {}}, "inputs"),
        ({"inputs": "word " * 400}, "max_input_tokens"),
        ([1, 2, 3], "body"),
    ],
)
def test_bad_inputs_are_422(client: httpx.Client, payload, mentions: str) -> None:
    r = client.post("/generate", json=payload)
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation" and mentions in r.json()["error"]


def test_stream_true_on_generate_is_422(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": "Hi", "stream": True})
    assert r.status_code == 422 and "/generate_stream" in r.json()["error"]


def test_malformed_json_is_422(client: httpx.Client) -> None:
    r = client.post("/generate", content=b'{"inputs": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_body_too_large_is_413_with_or_without_content_length(client: httpx.Client, server) -> None:
    big = {"inputs": "x" * (server.settings.max_body_bytes + 10)}
    r = client.post("/generate", json=big)
    assert r.status_code == 413 and "larger than" in r.json()["error"]
    assert r.json()["error_type"] == "payload_too_large"

    def chunks():
        yield b'{"inputs": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]


@pytest.mark.parametrize(
    "route,body,mentions",
    [
        ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"prompt": "", "max_tokens": 3}, "empty"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 100000}, "max_total_tokens"),
        ("/v1/completions", {"prompt": "Hi", "n": 17}, "n must be"),
        ("/v1/completions", {"prompt": "Hi", "n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"prompt": "Hi", "best_of": 3, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": [1, 10**9]}, "vocabulary"),
        ("/v1/completions", {"prompt": [[False]]}, "prompt"),  # found by schemathesis: once read as token id 0
        ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "3"}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "echo": 0}, "echo"),
        ("/v1/completions", {"prompt": []}, "empty"),
        ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, "suffix"),
        ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream=true"),
        (
            "/v1/completions",
            {"prompt": "Hi", "stream": True, "stream_options": {"bogus": True}},
            "stream_options.bogus",
        ),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "Hi", "metadata": {"a": "b"}}, "metadata"),
        ("/v1/completions", {"prompt": "Hi", "service_tier": "flex"}, "service_tier"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 9}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "presence_penalty": -2.5}, "presence_penalty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "logprobs=true"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}},
            },
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "type",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls",
        ),
        ("/v1/chat/completions", {"messages": []}, "empty"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": -3},
            "max_tokens",
        ),
    ],
)
def test_openai_routes_answer_400_in_openai_shape(client: httpx.Client, route: str, body: dict, mentions: str) -> None:
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and mentions in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_unknown_route_is_404_in_the_envelope(client: httpx.Client) -> None:
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error_type"] == "validation"
