"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (streaming or not) and ``/v1/models``.

Responses follow OpenAI's shapes closely enough that the official ``openai`` client works unchanged. Stop
sequences are cut from the text (OpenAI's convention); in streams, text that might begin a stop sequence is held
back until it is known not to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from service.engine import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from service.errors import openai_status
from service.runtime import EngineStream, request_id_of, runtime_of, sse
from service.stop_matcher import StopHoldback
from service.validation import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["OpenAI"])

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def openai_error(message: str, error_type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def _final_text(final: FinishEvent) -> str:
    return final.text[: final.stop_at] if final.stop_at is not None else final.text


def _usage(final: FinishEvent) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.generated_tokens,
        "total_tokens": final.prompt_tokens + final.generated_tokens,
    }


def _check_model(request: Request, name: str | None) -> str:
    """The served model's name. As in TGI, the request's ``model`` is not checked: one model is served, and
    clients that must send some name (huggingface_hub sends ``"dummy"``, others ``"tgi"``) work unchanged."""
    loaded = runtime_of(request).loaded
    served = loaded.name if loaded else ""
    if name and loaded and name not in (served, str(loaded.path)):
        log.debug("request names model %r; serving %r", name, served)
    return served


async def _start(request: Request, build) -> tuple[EngineStream, GenerationRequest]:
    runtime = runtime_of(request)
    engine, validator, _ = runtime.require_ready()
    gen = build(validator, request_id_of(request))
    slot = runtime.acquire()
    try:
        return EngineStream(engine, gen, slot), gen
    except BaseException:
        slot.release()
        raise


async def _final_or_response(stream: EngineStream, request: Request, rid: str) -> tuple[Any, Response | None]:
    """Wait for a non-streamed request's final event. When there is nothing to build an answer on (the client left,
    or generation failed), the second item is the response to send instead."""
    try:
        final = await stream.wait_final(request)
    finally:
        stream.close()
    if final is None:
        return None, Response(status_code=499)
    if isinstance(final, ErrorEvent):
        log.error("request %s failed: %s", rid, final.message)
        status = openai_status(final.status_code, final.error_type)
        return None, JSONResponse(openai_error(final.message, final.error_type), status_code=status)
    return final, None


def _stream_response(
    stream: EngineStream,
    gen: GenerationRequest,
    rid: str,
    make_chunk,
    first_chunk: dict[str, Any] | None,
    include_usage: bool,
) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        hold = StopHoldback(gen.stop)
        try:
            if first_chunk is not None:
                yield sse(first_chunk, "data: ")
            async for ev in stream.events():
                if isinstance(ev, ErrorEvent):
                    log.error("request %s failed mid-stream: %s", rid, ev.message)
                    yield sse(openai_error(ev.message, ev.error_type), "data: ")
                    return
                if not isinstance(ev, TokenEvent):
                    continue
                if ev.final is None:
                    piece = hold.push(ev.text)
                    if piece:
                        yield sse(make_chunk(piece, None, ev), "data: ")
                    continue
                stream.finished = True
                final = ev.final
                rest = hold.finish(_final_text(final))
                yield sse(make_chunk(rest, FINISH[final.reason], ev), "data: ")
                if include_usage:
                    last = make_chunk("", None, None)
                    last["choices"] = []
                    last["usage"] = _usage(final)
                    yield sse(last, "data: ")
                yield b"data: [DONE]\n\n"
                return
        finally:
            stream.close()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


@router.get("/models", summary="The served model")
async def models(request: Request) -> dict[str, Any]:
    runtime = runtime_of(request)
    loaded = runtime.loaded
    data = []
    if loaded is not None:
        data.append(
            {
                "id": loaded.name,
                "object": "model",
                "created": int(runtime.host.state.ready_at or time.time()),
                "owned_by": "loadmaster",
            }
        )
    return {"object": "list", "data": data}


@router.post("/completions", summary="Text completion (OpenAI shape)")
async def completions(request: Request, body: CompletionRequest) -> Response:
    name = _check_model(request, body.model)
    stream, gen = await _start(request, lambda v, rid: v.completion(body, rid))
    rid = request_id_of(request)
    cid, created = f"cmpl-{rid}", int(time.time())

    if body.stream:

        def chunk(text: str, finish: str | None, ev: TokenEvent | None) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return _stream_response(stream, gen, rid, chunk, None, include_usage)

    final, early = await _final_or_response(stream, request, rid)
    if early is not None:
        return early
    text = _final_text(final)
    logprobs = None
    if body.logprobs is not None:
        offsets, pos = [], 0
        for t in final.tokens:
            offsets.append(pos)
            pos += len(t.text)
        logprobs = {
            "tokens": [t.text for t in final.tokens],
            "token_logprobs": [t.logprob for t in final.tokens],
            "top_logprobs": None,
            "text_offset": offsets,
        }
    if body.echo:
        text = (body.prompt if isinstance(body.prompt, str) else body.prompt[0]) + text
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": FINISH[final.reason]}],
            "usage": _usage(final),
        }
    )


@router.post("/chat/completions", summary="Chat completion (OpenAI shape)")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    name = _check_model(request, body.model)
    stream, gen = await _start(request, lambda v, rid: v.chat(body, rid))
    rid = request_id_of(request)
    cid, created = f"chatcmpl-{rid}", int(time.time())

    def logprob_entry(ev: TokenEvent) -> dict[str, Any]:
        return {"token": ev.text, "logprob": ev.logprob, "bytes": list(ev.text.encode()), "top_logprobs": []}

    if body.stream:

        def chunk(text: str, finish: str | None, ev: TokenEvent | None) -> dict[str, Any]:
            delta = {"content": text} if text or finish is None else {}
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": {"content": [logprob_entry(ev)]} if body.logprobs and ev is not None else None,
                        "finish_reason": finish,
                    }
                ],
            }

        first = chunk("", None, None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return _stream_response(stream, gen, rid, chunk, first, include_usage)

    final, early = await _final_or_response(stream, request, rid)
    if early is not None:
        return early
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": _final_text(final)},
                    "logprobs": {"content": [logprob_entry(t) for t in final.tokens]} if body.logprobs else None,
                    "finish_reason": FINISH[final.reason],
                }
            ],
            "usage": _usage(final),
        }
    )
