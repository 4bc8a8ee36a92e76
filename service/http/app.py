"""The FastAPI application: ``create_app(settings)`` wires routes, middleware, error envelopes and the lifecycle.

The app starts answering at once; the model loads on a background thread (``/health/ready`` says how far).
Every error leaves as ``{"error", "error_type"}`` (OpenAI's ``{"error": {...}}`` with 400 under ``/v1``), with a
request id in the ``X-Request-Id`` header and in the log line; tracebacks stay in the log.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from planner.errors import LoadmasterError
from service.errors import (
    NOT_READY_RETRY_AFTER_S,
    GenerationError,
    NotReadyError,
    OverloadedError,
    RequestValidationError,
    ServiceError,
    http_status,
    openai_status,
)
from service.http import (
    access_log,
    plan_routes,
    request_body,
    tgi_routes,
    ui_routes,
)
from service.http.admission import Runtime
from service.http.agent_apis import messages_routes, responses_routes
from service.http.agent_apis.response_store import ResponseStore
from service.http.api_keys import check_api_key, is_open
from service.http.metrics import Metrics
from service.http.openai_apis import chat_routes, completions_routes
from service.http.storage_metrics import StorageCollector
from service.model.background_load import LoadedModel, Loader, ModelHost, load_model
from service.model.memory_report import memory_gauges, memory_report, weight_bytes_by_device
from service.schemas import openapi_document
from service.schemas.anthropic_responses import anthropic_error_body
from service.schemas.response_models import error_body, openai_error_body
from service.settings import ServiceSettings

log = logging.getLogger("service")


#: The route answering in Anthropic's shapes (its errors too).
ANTHROPIC_PATH = "/v1/messages"


def _is_openai(path: str) -> bool:
    return path.startswith("/v1/")


def error_response(
    path: str,
    status: int,
    message: str,
    error_type: str,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    """The one error envelope (or OpenAI's, under /v1, where validation errors are 400; Anthropic's on
    /v1/messages)."""
    if path.startswith(ANTHROPIC_PATH):
        status = openai_status(status, error_type)
        return JSONResponse(anthropic_error_body(message, status), status_code=status, headers=headers)
    if _is_openai(path):
        status = openai_status(status, error_type)
        body = openai_error_body(message, error_type, code, status)
    else:
        body = error_body(message, error_type)
    return JSONResponse(body, status_code=status, headers=headers)


#: A client's request id is kept when it is 1-64 of these ASCII characters; anything else is replaced whole by a
#: fresh id (never trimmed or re-encoded into something the client did not send).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def request_id(sent: str | None) -> str:
    """The request's id: the client's ``X-Request-Id`` if it is plain ASCII (letters, digits, ``-_.``, at most 64),
    else a new one."""
    if sent is not None and _REQUEST_ID.fullmatch(sent):
        return sent
    return uuid.uuid4().hex[:16]


class GuardMiddleware:
    """Pure ASGI middleware: request id, API key, body checks (size 413, type 415, strict JSON 422), the access-log
    line and per-route request metrics."""

    #: Bodies larger than this are checked on a worker thread, so a 1 MB prompt never holds the event loop.
    INLINE_CHECK_BYTES = 64 * 1024

    def __init__(self, app: Any, settings: ServiceSettings, metrics: Metrics):
        self.app = app
        self.settings = settings
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rid = request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        record = access_log.AccessRecord(request_id=rid, method=scope.get("method", ""), path=path)
        access_log.begin(record)
        status_holder = {"status": 500}

        async def send_wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        async def reply(resp: JSONResponse) -> None:
            await resp(scope, receive, send_wrapped)

        try:
            if self.settings.api_key and not is_open(scope.get("method", ""), path, headers.get("accept", "")):
                try:
                    check_api_key(headers.get("authorization"), self.settings.api_key, headers.get("x-api-key"))
                except ServiceError as exc:
                    log.info("request %s refused: %s", rid, exc)
                    await reply(
                        error_response(path, exc.status_code, str(exc), exc.error_type, {"WWW-Authenticate": "Bearer"})
                    )
                    return
            limit = self.settings.max_body_bytes
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await reply(self._refuse(path, rid, request_body.too_large(limit)))
                return
            # Read the whole body first (it is small by construction), so an oversized chunked body is
            # refused here, before the app parses anything.
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    await self.app(scope, receive, send_wrapped)  # a disconnect: let the app see it
                    return
                body += message.get("body", b"")
                if len(body) > limit:
                    await reply(self._refuse(path, rid, request_body.too_large(limit)))
                    return
                if not message.get("more_body", False):
                    break
            if body:
                try:
                    request_body.check_content_type(headers.get("content-type"))
                    if len(body) > self.INLINE_CHECK_BYTES:
                        await anyio.to_thread.run_sync(request_body.check_json, bytes(body))
                    else:
                        request_body.check_json(bytes(body))
                except RequestValidationError as exc:
                    await reply(self._refuse(path, rid, exc))
                    return
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
                return await receive()

            await self.app(scope, replay, send_wrapped)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or ("unmatched" if status_holder["status"] == 404 else path)
            record.route = label
            record.status = record.final_status(status_holder["status"])
            record.total_s = time.perf_counter() - record.started
            self.metrics.request_done(label, record.status, record.total_s)
            access_log.emit(record)

    @staticmethod
    def _refuse(path: str, rid: str, exc: RequestValidationError) -> JSONResponse:
        log.info("request %s refused: %s", rid, exc)
        return error_response(path, exc.status_code, str(exc), exc.error_type)


def _rid(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", "-"))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LoadmasterError)  # the service's own errors and the planner's and loader's
    async def loadmaster_error(request: Request, exc: LoadmasterError) -> JSONResponse:
        log.info("request %s: %s (%s)", _rid(request), exc, exc.error_type)
        headers = None
        if isinstance(exc, OverloadedError):
            headers = {"Retry-After": str(exc.retry_after)}
        elif isinstance(exc, NotReadyError):
            headers = {"Retry-After": str(NOT_READY_RETRY_AFTER_S)}
        code = getattr(exc, "code", None)
        return error_response(request.url.path, http_status(exc), str(exc), exc.error_type, headers, code)

    @app.exception_handler(FastAPIValidationError)
    async def validation_error(request: Request, exc: FastAPIValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            parts.append(f"{where}: {err.get('msg')}")
        error = RequestValidationError("Invalid request: " + "; ".join(parts))
        log.info("request %s: %s", _rid(request), error)
        return error_response(request.url.path, error.status_code, str(error), error.error_type)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (no such route, wrong method) carry their status; the type follows it.
        error_type = RequestValidationError.error_type if exc.status_code < 500 else GenerationError.error_type
        return error_response(request.url.path, exc.status_code, str(exc.detail), error_type, exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = _rid(request)
        log.error("request %s failed with an unexpected error", rid, exc_info=exc)
        error = GenerationError(f"Internal error (request id {rid}); the server logged the details.")
        return error_response(request.url.path, error.status_code, str(error), error.error_type)


def create_app(settings: ServiceSettings, loader: Loader | None = None) -> FastAPI:
    """Build the app. ``loader`` replaces the default plan-then-load (the tests use it to hold a load back)."""
    metrics = Metrics()
    host = ModelHost(settings, loader or load_model)
    runtime = Runtime(settings, host, metrics)

    storage = StorageCollector(lambda: runtime.loaded.plan if runtime.loaded else None, lambda: metrics.generated_total)
    metrics.registry.register(storage)

    def on_ready(loaded: LoadedModel) -> None:
        runtime.weight_bytes = weight_bytes_by_device(loaded.load_stats)
        storage.ready()

    host.on_ready(on_ready)
    metrics.memory_reader = lambda: memory_gauges(
        memory_report(runtime.loaded.plan if runtime.loaded else None, runtime.weight_bytes)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        host.start()
        yield
        runtime.shutdown()

    app = FastAPI(
        title="loadmaster",
        version=tgi_routes.VERSION,
        description="Big-model inference with planned device maps: TGI and OpenAI routes, /plan dry runs.",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.settings = settings
    app.state.response_store = ResponseStore(settings.responses_store_size)
    _install_error_handlers(app)
    app.include_router(tgi_routes.router)
    app.include_router(completions_routes.router)
    app.include_router(chat_routes.router)
    app.include_router(messages_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(plan_routes.router)
    app.include_router(ui_routes.router)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    openapi_document.install(app)
    return app
