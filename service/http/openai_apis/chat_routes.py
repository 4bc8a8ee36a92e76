"""``POST /v1/chat/completions``: chat in OpenAI's shape, with tool calls and reasoning read out of the text.

Each choice's output goes through an :class:`~service.tools.output_reader.OutputReader`: ``<think>`` blocks (and
harmony's analysis channel) become ``reasoning_content``, tool calls in the template's format become
``tool_calls`` (``finish_reason: "tool_calls"``), and in streams they come as OpenAI's deltas (the call's index,
id and name once, then argument fragments); text that may begin a tool call is held back, so no call's text leaks
into ``content``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.engine.requests import FinishEvent, TokenEvent
from service.http.admission import request_id_of, runtime_of
from service.http.openai_apis.v1_common import (
    FINISH,
    V1_ERRORS,
    chat_output_reader,
    check_model,
    finals_or_response,
    read_chat_output,
    start_request,
    stream_response,
    usage_of,
)
from service.schemas.openai_requests import ChatCompletionRequest, ChatShape, prepare_chat
from service.schemas.openapi_responses import GENERATION_ERRORS, errors, streamed
from service.schemas.response_models import ChatCompletionChunk, ChatCompletionResponse, OpenAIErrorEnvelope
from service.tools.output_reader import OutputReader

router = APIRouter(prefix="/v1", tags=["OpenAI"])


def _chat_logprob(ev: TokenEvent) -> dict[str, Any]:
    return {
        "token": ev.text,
        "logprob": ev.logprob,
        "bytes": list(ev.text.encode()),
        "top_logprobs": [
            {"token": a.text, "logprob": a.logprob, "bytes": list(a.text.encode())} for a in ev.top_tokens
        ],
    }


def _message(final: FinishEvent, shape: ChatShape) -> tuple[dict[str, Any], str]:
    """A choice's message and finish reason."""
    reasoning, content, calls = read_chat_output(final, shape)
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    finish = FINISH[final.reason]
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
        finish = "tool_calls" if final.reason != "length" else finish
    return message, finish


def _delta(reader: OutputReader, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A streamed chunk's delta for ``text``, and its finish reason (``tool_calls`` once calls were made)."""
    piece = reader.feed(text, final=finish is not None)
    delta: dict[str, Any] = {}
    if piece.reasoning:
        delta["reasoning_content"] = piece.reasoning
    if piece.content:
        delta["content"] = piece.content
    if piece.calls:
        delta["tool_calls"] = [
            {
                "index": c.index,
                **({"id": c.id, "type": "function"} if c.id else {}),
                "function": {**({"name": c.name} if c.name else {}), "arguments": c.arguments},
            }
            for c in piece.calls
        ]
    if finish is not None and finish != "length" and reader.calls():
        finish = "tool_calls"
    return delta, finish


@router.post(
    "/chat/completions",
    summary="Chat completion (OpenAI shape), with tools and reasoning",
    response_model=ChatCompletionResponse,
    responses={
        **streamed(
            "The chat completion, or (stream: true) chunks.",
            ChatCompletionChunk,
            OpenAIErrorEnvelope,
            done_sentinel=True,
        ),
        **errors(*V1_ERRORS, *GENERATION_ERRORS, 500, openai=True, client_closed=True),
    },
)
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    name = check_model(request, body.model)
    parser = runtime_of(request).settings.tool_call_parser
    streams, _, shape = await start_request(
        request, lambda v, rid: prepare_chat(v, body, rid, parser), body.user, bool(body.stream)
    )
    rid = request_id_of(request)
    cid, created = f"chatcmpl-{rid}", int(time.time())

    if body.stream:
        readers = [chat_output_reader(shape) for _ in streams]

        def chunk(i: int, text: str, finish: str | None, ev: TokenEvent | None) -> dict[str, Any] | None:
            delta, finish = _delta(readers[i], text, finish) if ev is not None else ({}, finish)
            logprobs = {"content": [_chat_logprob(ev)]} if body.logprobs and ev is not None else None
            if ev is not None and not delta and finish is None and logprobs is None:
                return None
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            }

        firsts = []
        for i in range(len(streams)):
            first = chunk(i, "", None, None) or {}
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            firsts.append(first)
        return stream_response(request, streams, rid, chunk, firsts, body.stream_options, body.logprobs, len(streams))

    finals, early = await finals_or_response(streams, request, rid)
    if early is not None:
        return early
    choices = []
    for i, final in enumerate(finals):
        message, finish = _message(final, shape)
        logprobs = {"content": [_chat_logprob(t) for t in final.tokens]} if body.logprobs else None
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage_of(finals, len(finals)),
        }
    )
