"""``POST /v1/messages``: Anthropic's Messages API over the chat machinery.

The request is rewritten as a chat request (:func:`~service.schemas.anthropic_requests.as_chat_request`) and
prepared by :func:`~service.schemas.openai_requests.prepare_chat`, so the template, the tool grammar (``tool_choice``
``any`` or ``tool``), sampling and limits are chat completions' own; the output is read into Anthropic's content
blocks (:mod:`service.http.agent_apis.output_blocks`). Streams use Anthropic's event names, each event's ``event:`` line
naming its ``type``. Errors take Anthropic's envelope (:func:`service.http.app.error_response`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from service.engine.requests import ErrorEvent, FinishEvent
from service.errors import openai_status
from service.http.admission import request_id_of, runtime_of
from service.http.agent_apis.output_blocks import (
    Block,
    BlockEvent,
    OutputBlocks,
    matched_stop,
    sequence_pieces,
    whole_blocks,
)
from service.http.event_stream import event_stream, typed_event
from service.http.openai_apis.v1_common import V1_ERRORS, check_model, finals_or_response, start_request
from service.schemas.anthropic_requests import MessagesRequest, as_chat_request
from service.schemas.anthropic_responses import (
    AnthropicErrorEnvelope,
    AnthropicMessageResponse,
    AnthropicStreamEvent,
    anthropic_error_body,
)
from service.schemas.openai_requests import ChatShape, prepare_chat
from service.schemas.openapi_responses import GENERATION_ERRORS, errors, streamed

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["Anthropic"])

#: Anthropic's stop reasons for the engine's (a tool call overrides all but max_tokens).
STOP_REASONS = {"length": "max_tokens", "eos_token": "end_turn", "stop_sequence": "stop_sequence"}


def _stop_reason(final: FinishEvent, called: bool) -> str:
    return "tool_use" if called and final.reason != "length" else STOP_REASONS[final.reason]


def _block(block: Block, whole: bool) -> dict[str, Any]:
    """A content block; in a stream's ``content_block_start`` (``whole=False``) it opens empty."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments() if whole else {}}


def _delta(event: BlockEvent) -> dict[str, Any]:
    kind = event.block.kind
    if kind == "reasoning":
        return {"type": "thinking_delta", "thinking": event.delta}
    if kind == "text":
        return {"type": "text_delta", "text": event.delta}
    return {"type": "input_json_delta", "partial_json": event.delta}


def _block_event(event: BlockEvent) -> dict[str, Any]:
    index = event.block.index
    if event.kind == "start":
        return {"type": "content_block_start", "index": index, "content_block": _block(event.block, whole=False)}
    if event.kind == "delta":
        return {"type": "content_block_delta", "index": index, "delta": _delta(event)}
    return {"type": "content_block_stop", "index": index}


def _stream(request: Request, stream: Any, shape: ChatShape, head: dict[str, Any]) -> Response:
    rid = request_id_of(request)

    async def events() -> AsyncIterator[ServerSentEvent]:
        blocks = OutputBlocks()
        usage = {"input_tokens": len(stream.request.prompt_ids), "output_tokens": 0}
        yield typed_event({"type": "message_start", "message": {**head, "content": [], "usage": dict(usage)}})
        yield typed_event({"type": "ping"})
        async for item in sequence_pieces(stream, shape):
            if isinstance(item, ErrorEvent):
                log.error("request %s failed mid-stream: %s", rid, item.message)
                status = openai_status(item.status_code, item.error_type)
                yield typed_event(anthropic_error_body(item.message, status))
                return
            if isinstance(item, FinishEvent):
                for ev in blocks.close():
                    yield typed_event(_block_event(ev))
                delta = {
                    "stop_reason": _stop_reason(item, blocks.has_calls),
                    "stop_sequence": matched_stop(item, stream.request.stop),
                }
                usage["output_tokens"] = item.generated_tokens
                yield typed_event({"type": "message_delta", "delta": delta, "usage": usage})
                yield typed_event({"type": "message_stop"})
                return
            for ev in blocks.take(item):
                yield typed_event(_block_event(ev))

    return event_stream(events(), runtime_of(request).settings)


@router.post(
    "/messages",
    summary="Messages (Anthropic shape), with tools",
    response_model=AnthropicMessageResponse,
    responses={
        **streamed("The message, or (stream: true) Anthropic's events.", AnthropicStreamEvent, AnthropicErrorEnvelope),
        **errors(*V1_ERRORS, 404, *GENERATION_ERRORS, 500, client_closed=True, envelope_model=AnthropicErrorEnvelope),
    },
)
async def messages(request: Request, body: MessagesRequest) -> Response:
    name = check_model(request, body.model)
    chat = as_chat_request(body)
    parser = runtime_of(request).settings.tool_call_parser
    streams, _, shape = await start_request(
        request, lambda v, rid: prepare_chat(v, chat, rid, parser), chat.user, bool(body.stream)
    )
    head = {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": name,
        "stop_reason": None,
        "stop_sequence": None,
    }
    if body.stream:
        return _stream(request, streams[0], shape, head)
    finals, early = await finals_or_response(
        streams, request, request_id_of(request), lambda message, _, status: anthropic_error_body(message, status)
    )
    if early is not None:
        return early
    final = finals[0]
    blocks, calls = whole_blocks(final, shape)
    return JSONResponse(
        {
            **head,
            "content": [_block(b, whole=True) for b in blocks],
            "stop_reason": _stop_reason(final, bool(calls)),
            "stop_sequence": matched_stop(final, streams[0].request.stop),
            "usage": {"input_tokens": final.prompt_tokens, "output_tokens": final.generated_tokens},
        }
    )
