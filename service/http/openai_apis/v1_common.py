"""What every ``/v1`` route shares, whichever API it speaks (OpenAI's completions and chat, the Responses and
Messages APIs): the model-name check, validation and submission, waiting for a non-streamed request's sequences,
the OpenAI chunk stream with stop-sequence holdback, usage counts and OpenAI's error envelope. The routes own only
their request and response shapes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from service.engine.requests import ErrorEvent, FinishEvent, TokenEvent
from service.engine.stop_matcher import StopHoldback
from service.errors import NotFoundError, openai_status
from service.http import access_log
from service.http.admission import (
    EngineStream,
    merged_events,
    open_streams,
    request_id_of,
    runtime_of,
    validated,
    wait_all,
)
from service.http.event_stream import event_stream, json_event, text_event
from service.schemas.openai_requests import ChatShape
from service.schemas.openapi_responses import BODY_ERRORS
from service.schemas.response_models import openai_error_body
from service.tools.call_parser import ToolCall
from service.tools.output_reader import OutputReader, read_whole

log = logging.getLogger(__name__)

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def openai_error(message: str, error_type: str, code: str | None = None, status: int | None = None) -> dict[str, Any]:
    return openai_error_body(message, error_type, code, status)


def _openai_error_of(message: str, error_type: str, status: int) -> dict[str, Any]:
    return openai_error(message, error_type, status=status)


def final_text(final: FinishEvent) -> str:
    return final.text[: final.stop_at] if final.stop_at is not None else final.text


def chat_output_reader(shape: ChatShape) -> OutputReader:
    """A streamed chat sequence's reader (reasoning, content, tool calls), as every chat-shaped API reads it."""
    tools = shape.tools
    return OutputReader(
        shape.prompt_text, shape.thinks, tools.fmt if tools else None, tools.names if tools else None, shape.harmony
    )


def read_chat_output(final: FinishEvent, shape: ChatShape) -> tuple[str | None, str, list[ToolCall]]:
    """A finished chat sequence's (reasoning or ``None``, content, tool calls): the whole-text twin of
    :func:`chat_output_reader`."""
    tools = shape.tools
    return read_whole(
        final_text(final),
        shape.prompt_text,
        shape.thinks,
        tools.fmt if tools else None,
        tools.names if tools else None,
        shape.harmony,
    )


def usage_of(finals: list[FinishEvent], per_prompt: int) -> dict[str, int]:
    """Token counts: each prompt once (its ``n`` sequences share it), every generated token (best_of's too)."""
    prompt = sum(f.prompt_tokens for f in finals[::per_prompt])
    generated = sum(f.generated_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


#: The names TGI's clients send for "the one model this endpoint serves".
PLACEHOLDER_MODELS = frozenset({"tgi", "dummy"})


def check_model(request: Request, name: str | None) -> str:
    """The served model's name. A request naming another model is a 404 ``model_not_found`` (as in vLLM), unless
    it names one of ``--served-model-name``'s aliases or the model's path, or ``--accept-any-model`` is set. No
    ``model`` at all is the served one, and so are TGI's placeholders (:data:`PLACEHOLDER_MODELS`: huggingface_hub
    sends ``"dummy"`` or ``"tgi"`` to a TGI endpoint, which serves one model whatever is named)."""
    runtime = runtime_of(request)
    loaded = runtime.loaded
    served = loaded.name if loaded else ""
    if not name or name in PLACEHOLDER_MODELS or loaded is None or runtime.settings.accept_any_model:
        return served
    if name not in (served, str(loaded.path), *runtime.settings.served_names()):
        raise NotFoundError(
            f"The model {name!r} does not exist on this server; it serves {served!r} (see GET /v1/models), or "
            "start it with --accept-any-model.",
            code="model_not_found",
        )
    return served


async def start_request(request: Request, build, user: str | None, stream: bool) -> tuple[list[EngineStream], Any, Any]:
    """Validate, take a slot per sequence, submit; also returns the validator (for decoding prompts) and what
    ``build`` returned beside the requests (when it returns a pair)."""
    runtime = runtime_of(request)
    engine, validator, _ = runtime.require_ready()
    built = await validated(build, validator, request_id_of(request))
    gens, extra = built if isinstance(built, tuple) else (built, None)
    if user:
        log.info("request %s: user %r", request_id_of(request), user)
        record = access_log.current()
        if record is not None:
            record.user = user
    return open_streams(runtime, engine, gens, stream), validator, extra


async def finals_or_response(
    streams: list[EngineStream],
    request: Request,
    rid: str,
    error_body: Callable[[str, str, int], dict[str, Any]] | None = None,
) -> tuple[list[FinishEvent], Response | None]:
    """Wait for every sequence of a non-streamed request. When there is nothing to build an answer on (the client
    left, or a sequence failed), the second item is the response to send instead: its body is ``error_body``'s
    (message, error type, status), OpenAI's envelope unless the route has its own."""
    finals = await wait_all(streams, request)
    if finals is None:
        return [], Response(status_code=499)
    for final in finals:
        if isinstance(final, ErrorEvent):
            log.error("request %s failed: %s", rid, final.message)
            status = openai_status(final.status_code, final.error_type)
            body = (error_body or _openai_error_of)(final.message, final.error_type, status)
            return [], JSONResponse(body, status_code=status)
    return [f for f in finals if isinstance(f, FinishEvent)], None


def _running_usage(streams: list[EngineStream], counts: list[int], per_prompt: int) -> dict[str, int]:
    """vLLM's ``continuous_usage_stats``: the request's token counts so far, on every chunk."""
    prompt = sum(len(s.request.prompt_ids) for s in streams[::per_prompt])
    generated = sum(counts)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def stream_response(
    request: Request,
    streams: list[EngineStream],
    rid: str,
    make_chunk: Callable[[int, str, str | None, TokenEvent | None], dict[str, Any] | None],
    first_chunks: list[dict[str, Any]],
    stream_options: dict[str, Any] | None,
    every_token: bool,
    per_prompt: int,
) -> EventSourceResponse:
    """Server-sent chunks for one or more sequences (choice ``i`` is stream ``i``). With ``every_token`` (logprobs
    asked for) each token gets a chunk even while its text is held back; ``make_chunk`` may return ``None`` for a
    token that adds nothing to send yet. ``stream_options``: ``include_usage`` adds a last chunk with the usage,
    ``continuous_usage_stats`` (vLLM's) a ``usage`` on every chunk."""
    include_usage = bool((stream_options or {}).get("include_usage"))
    continuous = bool((stream_options or {}).get("continuous_usage_stats"))

    async def events() -> AsyncIterator[ServerSentEvent]:
        holds = [StopHoldback(s.request.stop) for s in streams]
        counts = [0] * len(streams)
        finals: dict[int, FinishEvent] = {}

        def send(chunk: dict[str, Any]) -> ServerSentEvent:
            if continuous:
                chunk["usage"] = _running_usage(streams, counts, per_prompt)
            return json_event(chunk)

        try:
            for first in first_chunks:
                yield send(first)
            async for i, ev in merged_events(streams):
                if isinstance(ev, ErrorEvent):
                    log.error("request %s failed mid-stream: %s", rid, ev.message)
                    yield json_event(openai_error(ev.message, ev.error_type))
                    return
                if not isinstance(ev, TokenEvent):
                    continue
                counts[i] += 1
                if ev.final is None:
                    piece = holds[i].push(ev.text)
                    chunk = make_chunk(i, piece, None, ev) if piece or every_token else None
                else:
                    finals[i] = ev.final
                    rest = holds[i].finish(final_text(ev.final))
                    chunk = make_chunk(i, rest, FINISH[ev.final.reason], ev)
                if chunk is not None:
                    yield send(chunk)
            if include_usage:
                last = make_chunk(0, "", None, None) or {}
                last["choices"] = []
                last["usage"] = usage_of([finals[i] for i in sorted(finals)], per_prompt)
                yield json_event(last)
            yield text_event("[DONE]")
        finally:
            for stream in streams:
                stream.close()

    return event_stream(events(), runtime_of(request).settings)


#: The statuses every ``/v1`` route may answer (the middleware's, in OpenAI's envelope: validation is 400 here).
V1_ERRORS = (400, 401, *(s for s in BODY_ERRORS if s != 422))
