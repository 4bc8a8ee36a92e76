"""Server-sent event responses for every stream, on ``sse-starlette``'s :class:`EventSourceResponse`.

The library frames the events, sends keep-alive pings, and cancels the body generator when the client goes away
(the generator's ``finally`` then cancels the sequence, which the access log counts as 499). Two choices keep what
clients and the server already relied on:

- Lines end in ``\\n`` (the library's default is ``\\r\\n``): the web page splits events on ``\\n\\n``, and the
  bytes of each ``data: {json}`` event stay what TGI's ``text-generation``, ``openai`` and huggingface_hub's
  ``InferenceClient`` have always parsed. Pings are SSE comments (``: ping ...``), which every one of them skips.
- The library would cancel every stream as soon as uvicorn gets SIGTERM; this server instead lets streams run
  through ``--grace-period`` and then sends each a final error event (:meth:`Runtime.end_grace_period`). So the
  library's own shutdown grace is set past that, to uvicorn's hard stop: it never cuts a stream first.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent

from service.settings import ServiceSettings

#: SSE line separator: ``\n``, as the server has always framed its events.
SEPARATOR = "\n"


def json_event(data: Any) -> ServerSentEvent:
    """One ``data: {json}`` event. Compact JSON, non-ASCII kept as is (as before the library framed it)."""
    return ServerSentEvent(data=json.dumps(data, separators=(",", ":"), ensure_ascii=False), sep=SEPARATOR)


def typed_event(data: dict[str, Any]) -> ServerSentEvent:
    """One ``event: <type>`` + ``data: {json}`` event, as Anthropic's and the Responses API's streams frame them
    (the event's name is its ``type``)."""
    return ServerSentEvent(
        data=json.dumps(data, separators=(",", ":"), ensure_ascii=False), event=data["type"], sep=SEPARATOR
    )


def text_event(text: str) -> ServerSentEvent:
    """One ``data: <text>`` event (OpenAI's closing ``[DONE]``)."""
    return ServerSentEvent(data=text, sep=SEPARATOR)


def event_stream(events: AsyncIterator[ServerSentEvent], settings: ServiceSettings) -> EventSourceResponse:
    """The response for a stream of events: pings every ``sse_ping_interval`` seconds (0: none), and no library
    shutdown cut before the server's own grace period and uvicorn's deadline are over."""
    return EventSourceResponse(
        events,
        sep=SEPARATOR,
        ping=settings.sse_ping_interval,
        headers={"Cache-Control": "no-cache"},
        shutdown_grace_period=settings.hard_stop_s,
    )
