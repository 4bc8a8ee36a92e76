"""The ``responses=`` tables of the route decorators: which error statuses each route really answers, with which
envelope, and how a stream is framed.

What every route shares comes from :class:`service.http.app.GuardMiddleware`: a body over ``--max-body-bytes`` is 413, a
body that is not JSON is 415, and malformed JSON (NaN, lone surrogates, deep nesting) is 422, on any route that is
sent a body; a missing or wrong key is 401 on every route but the open ones (:data:`service.http.api_keys.OPEN_PATHS`,
the page). The routes add their own: 429 when the server is full, 503 while it loads or drains, 499 when the client
left before the answer. Under ``/v1`` errors take OpenAI's envelope and a validation failure is 400, not 422.

Error schemas are ``$ref``\\ s to :mod:`service.schemas.response_models`, which :mod:`service.schemas.openapi_document` places in
the document's components (so a route whose success is HTML or SVG still documents JSON errors).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from service.errors import NOT_READY_RETRY_AFTER_S
from service.schemas.response_models import ErrorEnvelope, OpenAIErrorEnvelope

#: What each error status means on this server (the description in the document).
ERROR_MEANINGS: dict[int, str] = {
    400: "The request failed validation (OpenAI's status for it); the message names the field.",
    401: "No API key, or a wrong one (only when the server runs with --api-key): send 'Authorization: Bearer <key>'.",
    403: "The model path leads outside the model roots, or names a Hub model on a server without --allow-hub-plan.",
    404: "The model named does not exist here.",
    413: "The request body is over --max-body-bytes (on /plan also: a model with more tensors than it plans for).",
    415: "The request body is not JSON: send 'Content-Type: application/json'.",
    422: "The request is malformed or outside the limits; the message names the field and the limit.",
    429: "The server is at its concurrency limit: retry after Retry-After seconds.",
    500: "Generation failed inside the engine (out of memory in a step, a model error); the log has the details.",
    503: "The model is still loading, failed to load, or the server is shutting down: retry after Retry-After.",
}

#: The client closed the connection before the answer: the access log and metrics count the request as 499;
#: nobody reads this status, and it has no body.
CLIENT_CLOSED_RESPONSE: dict[str, Any] = {"description": "The client left before the answer (counted, never read)."}

_RETRY_AFTER = {
    "Retry-After": {
        "description": f"Seconds to wait before retrying ({NOT_READY_RETRY_AFTER_S} while loading or draining).",
        "schema": {"type": "integer"},
    }
}

#: Statuses :class:`service.http.app.GuardMiddleware` answers on any route that is sent a body.
BODY_ERRORS = (413, 415, 422)
#: Statuses of every generation route before its answer starts (besides the body's and the key's).
GENERATION_ERRORS = (429, 503)


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    """A JSON-schema ``$ref`` to ``model`` in the document's components."""
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def errors(
    *statuses: int, openai: bool = False, client_closed: bool = False, envelope_model: type[BaseModel] | None = None
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for ``statuses``, each with the route's envelope (OpenAI's under ``/v1``, or
    ``envelope_model``: Anthropic's on ``/v1/messages``), plus 499 when the route can notice that its client left."""
    envelope = schema_ref(envelope_model or (OpenAIErrorEnvelope if openai else ErrorEnvelope))
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted(set(statuses)):
        entry: dict[str, Any] = {"description": ERROR_MEANINGS[status], "content": json_content(envelope)}
        if status in (429, 503):
            entry["headers"] = _RETRY_AFTER
        out[status] = entry
    if client_closed:
        out[499] = CLIENT_CLOSED_RESPONSE
    return out


def event_stream(*event_models: type[BaseModel], done_sentinel: bool = False) -> dict[str, Any]:
    """The ``text/event-stream`` content of a streamed answer: each event's ``data`` is one JSON object, one of
    ``event_models`` (the last of them being the error event a failure mid-stream sends); OpenAI's streams end
    with ``data: [DONE]``."""
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [schema_ref(m) for m in event_models]},
    }
    if done_sentinel:
        data = {"anyOf": [data, {"const": "[DONE]"}]}
    names = ", ".join(m.__name__ for m in event_models)
    ending = ", then 'data: [DONE]'." if done_sentinel else "."
    return {
        "text/event-stream": {
            # Open API 3.2's itemSchema (as FastAPI's own SSE routes write it): one event. No 'schema' beside it,
            # which 3.2 reads as the whole stream.
            "itemSchema": {
                "type": "object",
                "description": f"One server-sent event, 'data: <JSON>' ({names}){ending}",
                "required": ["data"],
                "properties": {"data": data},
            }
        }
    }


def streamed(description: str, *event_models: type[BaseModel], done_sentinel: bool = False) -> dict[int, Any]:
    """A ``responses=`` entry for a 200 that is (or, with ``stream: true``, may be) an event stream."""
    return {200: {"description": description, "content": event_stream(*event_models, done_sentinel=done_sentinel)}}


def plain_content(media_type: str, description: str) -> dict[int, Any]:
    """A ``responses=`` entry for a 200 whose body is text (metrics, HTML, SVG)."""
    return {200: {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}}
