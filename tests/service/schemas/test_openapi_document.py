"""The OpenAPI document itself: every operation documents its errors with the error envelope, a non-empty 200, and
the streams as ``text/event-stream``. (Whether the server's answers match it is tests/service/schemas/test_openapi_fuzz.py.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.responses import JSONResponse

from service.http.app import create_app, error_response
from service.schemas.anthropic_responses import AnthropicErrorEnvelope
from service.schemas.response_models import ErrorEnvelope, OpenAIErrorEnvelope
from service.settings import ServiceSettings

ENVELOPE = "#/components/schemas/ErrorEnvelope"
OPENAI_ENVELOPE = "#/components/schemas/OpenAIErrorEnvelope"
ANTHROPIC_ENVELOPE = "#/components/schemas/AnthropicErrorEnvelope"
#: The routes that stream (always, or with ``stream: true``), and the event each one's data holds.
STREAMS = {
    ("post", "/generate_stream"): "TGIStreamEvent",
    ("post", "/"): "TGIStreamEvent",
    ("post", "/v1/completions"): "CompletionChunk",
    ("post", "/v1/chat/completions"): "ChatCompletionChunk",
    ("post", "/v1/messages"): "AnthropicStreamEvent",
    ("post", "/v1/responses"): "ResponseStreamEvent",
}
#: The streams that end with ``data: [DONE]`` (chat completions' and completions'; the typed-event streams of the
#: Messages and Responses APIs end with their own last event).
DONE_SENTINEL = {"/v1/completions", "/v1/chat/completions"}


def envelope_of(path: str) -> str:
    """The error envelope a path answers with: Anthropic's on /v1/messages, OpenAI's elsewhere under /v1."""
    if path == "/v1/messages":
        return ANTHROPIC_ENVELOPE
    return OPENAI_ENVELOPE if path.startswith("/v1/") else ENVELOPE


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(ServiceSettings(model="unused")).openapi()


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, ops in doc["paths"].items() for method, op in ops.items()]


def test_every_route_of_the_app_is_in_the_document(document: dict[str, Any]) -> None:
    documented = {(m, p) for m, p, _ in operations(document)}
    expected = {("head", "/health"), ("get", "/health"), ("post", "/generate"), ("post", "/plan"), ("get", "/ui")}
    assert expected <= documented
    assert len(documented) >= 16


def test_every_route_documents_its_validation_error_with_the_envelope(document: dict[str, Any]) -> None:
    for method, path, op in operations(document):
        openai = path.startswith("/v1/")
        status = "400" if openai else "422"  # OpenAI's clients expect 400 for a request that fails validation
        entry = op["responses"].get(status)
        assert entry is not None, f"{method.upper()} {path} documents no {status}"
        schema = entry["content"]["application/json"]["schema"]
        assert schema == {"$ref": envelope_of(path)}, (method, path, schema)
        if openai:
            assert "422" not in op["responses"], f"{method.upper()} {path}: /v1 never answers 422"


def test_every_error_status_has_the_envelope_and_nothing_is_left_to_fastapi(document: dict[str, Any]) -> None:
    for method, path, op in operations(document):
        for status, entry in op["responses"].items():
            if not status.startswith(("4", "5")) or status == "499":  # 499 is a log status, never read: no body
                continue
            schema = entry["content"]["application/json"]["schema"]
            if (method, path, status) == ("get", "/health/ready", "503"):
                assert schema == {"$ref": "#/components/schemas/LoadState"}  # the progress, not an error
                continue
            assert schema["$ref"] == envelope_of(path), (method, path, status)
            if status in ("429", "503"):
                assert "Retry-After" in entry["headers"], (method, path, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_every_200_has_a_schema(document: dict[str, Any]) -> None:
    for method, path, op in operations(document):
        ok = op["responses"]["200"]
        if method == "head":
            assert "content" not in ok  # a HEAD answer has no body
            continue
        assert ok["content"], (method, path)
        for media, entry in ok["content"].items():
            schema = entry.get("itemSchema") if media == "text/event-stream" else entry.get("schema")
            assert schema, f"{method.upper()} {path}: empty 200 schema for {media}"


def test_streaming_routes_list_their_events(document: dict[str, Any]) -> None:
    for (method, path), event in STREAMS.items():
        stream = document["paths"][path][method]["responses"]["200"]["content"]["text/event-stream"]
        data = stream["itemSchema"]["properties"]["data"]
        text = json.dumps(data)
        assert f"#/components/schemas/{event}" in text, (path, data)
        assert envelope_of(path) in text  # a failure mid-stream
        assert ("[DONE]" in text) == (path in DONE_SENTINEL)
    streamed = {
        (m, p) for m, p, op in operations(document) if "text/event-stream" in op["responses"]["200"].get("content", {})
    }
    assert streamed == set(STREAMS)


def test_every_reference_resolves(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    refs = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("$ref"), str):
                refs.add(value["$ref"])
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(document)
    missing = {r for r in refs if r.removeprefix("#/components/schemas/") not in schemas}
    assert not missing


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/messages"])
def test_the_envelope_models_are_what_the_server_sends(path: str) -> None:
    response = error_response(path, 422, "temperature must be > 0", "validation")
    assert isinstance(response, JSONResponse)
    body = json.loads(bytes(response.body))
    if path == "/v1/messages":
        assert response.status_code == 400
        error = AnthropicErrorEnvelope.model_validate(body).error
        assert (error.type, error.message) == ("invalid_request_error", "temperature must be > 0")
    elif path.startswith("/v1/"):
        assert response.status_code == 400
        assert OpenAIErrorEnvelope.model_validate(body).error.message == "temperature must be > 0"
    else:
        assert response.status_code == 422
        assert ErrorEnvelope.model_validate(body).error_type == "validation"


def test_request_schemas_say_what_the_server_takes(document: dict[str, Any]) -> None:
    """What the fuzz test's negative_data_rejection found: TGI's stop takes null (read as none), and a key the
    models do not declare is taken only unset (what refuse_unknown lets through), else refused."""
    schemas = document["components"]["schemas"]
    stop = schemas["TGIParameters"]["properties"]["stop"]
    assert {"type": "null"} in stop["anyOf"]
    for name in ("TGIRequest", "TGIParameters", "CompletionRequest", "ChatCompletionRequest", "ChatMessage"):
        extra = schemas[name]["additionalProperties"]
        assert extra is not True and {"type": "null"} in extra["anyOf"], name
    assert schemas["PlanRequest"]["additionalProperties"] is False
    assert schemas["TGIRequest"]["examples"] and schemas["ChatCompletionRequest"]["examples"]


def test_the_plan_response_models_name_every_field_the_planner_serialises() -> None:
    """The /plan response models are strict (``extra: forbid``), so a field added to the planner's records and not
    to them makes every /plan answer violate the document; this catches it without a server."""
    from dataclasses import fields

    from planner.types import DeviceBudget, Plan, Prediction, Workload
    from service.schemas.response_models import PlanBudget, PlanPrediction, PlanResponse, PlanWorkload

    def names(record: type) -> set[str]:
        return {f.name for f in fields(record)}

    assert set(PlanResponse.model_fields) - {"what_if"} == names(Plan)
    assert set(PlanWorkload.model_fields) == names(Workload)
    assert set(PlanBudget.model_fields) == names(DeviceBudget) | {"total", "free"}
    assert set(PlanPrediction.model_fields) == names(Prediction)
