"""``POST /v1/responses``: OpenAI's Responses API over the chat machinery.

The conversation (a stored response's items when ``previous_response_id`` names one, then ``input``) is rewritten
as a chat request (:func:`~service.schemas.responses_requests.as_chat_request`) and prepared by
:func:`~service.schemas.openai_requests.prepare_chat`; the output is read into output items (``reasoning``,
``message`` with ``output_text``, ``function_call``) by :mod:`service.http.agent_apis.output_blocks`. Streams send
the Responses events, each with its ``sequence_number``, the items' ids the same in the events and in the final
``response.completed`` (as the openai client's stream accumulator checks). Errors take OpenAI's envelope.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from service.engine.requests import ErrorEvent, FinishEvent
from service.http.admission import request_id_of, runtime_of
from service.http.agent_apis.output_blocks import Block, BlockEvent, OutputBlocks, sequence_pieces, whole_blocks
from service.http.agent_apis.response_store import ResponseStore
from service.http.event_stream import event_stream, typed_event
from service.http.openai_apis.v1_common import V1_ERRORS, check_model, finals_or_response, openai_error, start_request
from service.schemas.openai_requests import ChatShape, prepare_chat
from service.schemas.openapi_responses import GENERATION_ERRORS, errors, streamed
from service.schemas.response_models import OpenAIErrorEnvelope
from service.schemas.responses_models import ResponseObject, ResponseStreamEvent
from service.schemas.responses_requests import ResponsesRequest, as_chat_request, input_items

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["OpenAI Responses"])

_ID_PREFIX = {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}


def store_of(request: Request) -> ResponseStore:
    return request.app.state.response_store


@dataclass
class _Draft:
    """What a response object is built from besides its output: the request, and ids and counts of this answer."""

    body: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    item_ids: dict[int, str] = field(default_factory=dict)

    def item_id(self, block: Block) -> str:
        return self.item_ids.setdefault(block.index, _ID_PREFIX[block.kind] + uuid.uuid4().hex[:24])

    def item(self, block: Block, done: bool) -> dict[str, Any]:
        """The output item of ``block``; while it streams (``done=False``) it opens empty."""
        status = "completed" if done else "in_progress"
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": block.text}] if done else []
            return {"type": "reasoning", "id": self.item_id(block), "summary": [], "content": content}
        if block.kind == "text":
            content = [_text_part(block.text)] if done else []
            return {
                "type": "message",
                "id": self.item_id(block),
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "type": "function_call",
            "id": self.item_id(block),
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.text if done else "",
            "status": status,
        }

    def response(self, blocks: list[Block] | None, final: FinishEvent | None) -> dict[str, Any]:
        """The response object: in progress (``final`` is ``None``), completed, or incomplete (the token limit)."""
        body = self.body
        status, incomplete = "in_progress", None
        if final is not None:
            status = "incomplete" if final.reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if final.reason == "length" else None
        usage = None
        if final is not None:
            usage = {
                "input_tokens": final.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": final.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": final.prompt_tokens + final.generated_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [self.item(b, done=True) for b in blocks or []],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": usage,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_events(answer: _Draft, ev: BlockEvent) -> list[dict[str, Any]]:
    """The Responses events of one block event (without sequence numbers)."""
    block = ev.block
    where = {"item_id": answer.item_id(block), "output_index": block.index}
    if ev.kind == "start":
        out = [{"type": "response.output_item.added", "output_index": block.index, "item": answer.item(block, False)}]
        if block.kind == "text":
            out.append({"type": "response.content_part.added", **where, "content_index": 0, "part": _text_part("")})
        return out
    if ev.kind == "delta":
        if block.kind == "text":
            return [
                {"type": "response.output_text.delta", **where, "content_index": 0, "delta": ev.delta, "logprobs": []}
            ]
        if block.kind == "reasoning":
            return [{"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": ev.delta}]
        return [{"type": "response.function_call_arguments.delta", **where, "delta": ev.delta}]
    out = []
    if block.kind == "text":
        out.append(
            {"type": "response.output_text.done", **where, "content_index": 0, "text": block.text, "logprobs": []}
        )
        out.append({"type": "response.content_part.done", **where, "content_index": 0, "part": _text_part(block.text)})
    elif block.kind == "reasoning":
        out.append({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": block.text})
    else:
        out.append(
            {"type": "response.function_call_arguments.done", **where, "name": block.name, "arguments": block.text}
        )
    out.append({"type": "response.output_item.done", "output_index": block.index, "item": answer.item(block, True)})
    return out


def output_items(answer: _Draft, blocks: list[Block]) -> list[dict[str, Any]]:
    """The output as input items, for the store (what the next request's ``input`` continues)."""
    out: list[dict[str, Any]] = []
    for b in blocks:
        if b.kind == "text":
            out.append({"type": "message", "role": "assistant", "content": b.text})
        elif b.kind == "tool_call":
            out.append({"type": "function_call", "call_id": b.call_id, "name": b.name, "arguments": b.text})
    return out


def _stream(request: Request, stream: Any, shape: ChatShape, answer: _Draft, items: list[dict[str, Any]]) -> Response:
    rid = request_id_of(request)

    async def events() -> AsyncIterator[ServerSentEvent]:
        blocks, seq = OutputBlocks(), 0

        def send(data: dict[str, Any]) -> ServerSentEvent:
            nonlocal seq
            data["sequence_number"], seq = seq, seq + 1
            return typed_event(data)

        yield send({"type": "response.created", "response": answer.response(None, None)})
        yield send({"type": "response.in_progress", "response": answer.response(None, None)})
        async for piece in sequence_pieces(stream, shape):
            if isinstance(piece, ErrorEvent):
                log.error("request %s failed mid-stream: %s", rid, piece.message)
                detail = openai_error(piece.message, piece.error_type)["error"]
                yield send({"type": "error", "code": detail["type"], "message": detail["message"], "param": None})
                return
            if isinstance(piece, FinishEvent):
                for ev in blocks.close():
                    for data in _item_events(answer, ev):
                        yield send(data)
                response = answer.response(blocks.blocks, piece)
                if answer.body.store:
                    store_of(request).put(answer.id, items + output_items(answer, blocks.blocks))
                kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                yield send({"type": kind, "response": response})
                return
            for ev in blocks.take(piece):
                for data in _item_events(answer, ev):
                    yield send(data)

    return event_stream(events(), runtime_of(request).settings)


@router.post(
    "/responses",
    summary="Responses (OpenAI's Responses API), with function tools",
    response_model=ResponseObject,
    responses={
        **streamed("The response, or (stream: true) its events.", ResponseStreamEvent, OpenAIErrorEnvelope),
        **errors(*V1_ERRORS, 404, *GENERATION_ERRORS, 500, openai=True, client_closed=True),
    },
)
async def responses(request: Request, body: ResponsesRequest) -> Response:
    name = check_model(request, body.model)
    items = store_of(request).conversation(body.previous_response_id) if body.previous_response_id else []
    items = items + input_items(body)
    chat = as_chat_request(body, items)
    parser = runtime_of(request).settings.tool_call_parser
    streams, _, shape = await start_request(
        request, lambda v, rid: prepare_chat(v, chat, rid, parser), body.user, bool(body.stream)
    )
    answer = _Draft(body=body, model=name)
    if body.stream:
        return _stream(request, streams[0], shape, answer, items)
    finals, early = await finals_or_response(streams, request, request_id_of(request))
    if early is not None:
        return early
    blocks, _ = whole_blocks(finals[0], shape)
    if body.store:
        store_of(request).put(answer.id, items + output_items(answer, blocks))
    return JSONResponse(answer.response(blocks, finals[0]))
