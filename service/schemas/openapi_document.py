"""``GET /openapi.json``: FastAPI's document, completed where the route decorators cannot say it themselves.

FastAPI places in the components only the models a route's body or ``response_model`` reaches. The error envelopes
and the stream events are referenced from ``responses=`` (:mod:`service.schemas.openapi_responses`) by ``$ref``, so this
adds them. And FastAPI documents a 422 with its own ``HTTPValidationError`` shape on every route with a body unless
the route lists one; under ``/v1`` validation failures are 400 in OpenAI's envelope (``service.http.app.error_response``)
and 422 never comes, so that entry is removed there rather than left to describe an answer the server never gives.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from service.schemas import anthropic_responses as ar
from service.schemas import response_models as rm
from service.schemas import responses_models as rs

#: Models the document references by ``$ref`` from ``responses=`` tables.
REFERENCED_MODELS: tuple[type, ...] = (
    rm.ErrorEnvelope,
    rm.OpenAIErrorEnvelope,
    rm.TGIStreamEvent,
    rm.CompletionChunk,
    rm.ChatCompletionChunk,
    ar.AnthropicErrorEnvelope,
    ar.AnthropicStreamEvent,
    rs.ResponseStreamEvent,
)

_FASTAPI_422 = "#/components/schemas/HTTPValidationError"


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The document, built once per app and cached as FastAPI does (``app.openapi_schema``)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=app.description,
        routes=app.routes,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _, extra = models_json_schema(
        [(m, "serialization") for m in REFERENCED_MODELS], ref_template="#/components/schemas/{model}"
    )
    for name, schema in extra.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    for path, operations in doc.get("paths", {}).items():
        if not path.startswith("/v1/"):
            continue
        for operation in operations.values():
            entry = operation.get("responses", {}).get("422")
            if entry and entry.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref") == (
                _FASTAPI_422
            ):
                del operation["responses"]["422"]
    _drop_unreferenced(doc, ("HTTPValidationError", "ValidationError"))
    app.openapi_schema = doc
    return doc


def _drop_unreferenced(doc: dict[str, Any], names: tuple[str, ...]) -> None:
    """Remove FastAPI's validation-error schemas once no route refers to them."""
    import json

    schemas = doc["components"]["schemas"]
    for name in names:
        text = json.dumps({k: v for k, v in doc.items() if k != "components"}) + json.dumps(
            {k: v for k, v in schemas.items() if k not in names}
        )
        if f'"#/components/schemas/{name}"' not in text:
            schemas.pop(name, None)


def install(app: FastAPI) -> None:
    """Serve :func:`build_openapi`'s document at ``/openapi.json`` (and to the docs pages)."""
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]
