"""The connection layer's own limits, which uvicorn (0.55, h11) does not have: a request head must arrive within
``header_timeout`` seconds, a request body may pause at most ``body_timeout`` seconds between reads, and a request
that carries both ``Content-Length`` and ``Transfer-Encoding`` is refused and its connection closed.

Why here, in uvicorn's protocol, and not elsewhere (measured on this machine, see docs/operations.md):

- uvicorn's own options cannot do it: ``timeout_keep_alive`` is armed only after a response, so an idle socket that
  never sent a byte, or one trickling its headers, stays open forever; there is no header or body read timeout in
  ``h11_impl`` (nor in ``httptools_impl``, which is not installed here); and h11 serves CL+TE (it reads the chunked
  body) and keeps the connection alive.
- An ASGI middleware cannot see a connection before its request head is complete, so it cannot time headers, and
  it cannot close a connection (only ask, with ``Connection: close`` on its answer).
- Another server (hypercorn, granian) has read timeouts, but changes the streaming, drain and shutdown behaviour
  the service and its tests rely on, for three small timers.

So :func:`guarded_protocol` subclasses uvicorn's h11 protocol: one timer per connection, re-armed as the request
moves on (head → body → the app's turn, when no timer runs: a long generation or stream is never cut), and h11's
``next_event`` checked for CL+TE (RFC 9112 §6.1: "the server MUST close the connection after responding"), which
uvicorn then answers with 400 and a close, as for any request h11 itself refuses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("service.connections")

#: What a connection that did not finish its request head in time is told before it is closed (nginx's answer).
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline, a body idle limit and CL+TE refused."""

    header_timeout: float = 30.0
    body_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._timing: str | None = None  # "head" or "body": what the running timer waits for
        self._head_bytes = 0  # bytes of the request head received so far (0: an idle connection)
        inner = self.conn.next_event

        def next_event() -> Any:
            event = inner()
            if isinstance(event, h11.Request) and _has_both_lengths(event.headers):
                raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding (RFC 9112 §6.1)")
            return event

        self.conn.next_event = next_event  # type: ignore[method-assign]

    # -- uvicorn's hooks ---------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._head_bytes += len(data)
        super().data_received(data)
        self._follow(data_arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_bytes = 0
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    # -- the timer ---------------------------------------------------------------------------------------------------
    def _follow(self, data_arrived: bool = False) -> None:
        """Arm, keep or cancel the timer for the connection's state: waiting for a head (one deadline for the whole
        head, however it trickles), reading a body (the limit restarts with each read), or the app's turn (none)."""
        if self.transport is None or self.transport.is_closing():
            self._cancel()
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.cycle_done():
            if self._timing != "head":
                self._arm("head", self.header_timeout)
        elif state is h11.SEND_BODY:
            if self._timing != "body" or data_arrived:
                self._arm("body", self.body_timeout)
        else:
            self._cancel()

    def cycle_done(self) -> bool:
        """Whether no request of this connection is being answered (a pipelined head waits for the answer)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, what: str, seconds: float) -> None:
        self._cancel()
        if seconds > 0:
            self._timing = what
            self._read_timer = self.loop.call_later(seconds, self._expired)

    def _cancel(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._timing = None, None

    def _expired(self) -> None:
        what, self._read_timer, self._timing = self._timing, None, None
        if self.transport.is_closing():
            return
        if what == "body" and self.flow.read_paused:
            self._arm("body", self.body_timeout)  # we stopped reading (the app is behind), not the client
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        if what == "head":
            log.debug("closing the connection of %s: no complete request head in %.0fs", client, self.header_timeout)
            if self._head_bytes:
                self.transport.write(_REQUEST_TIMEOUT)
        else:
            log.debug("closing the connection of %s: its request body paused over %.0fs", client, self.body_timeout)
        self.transport.close()


def _has_both_lengths(headers: Any) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def guarded_protocol(header_timeout: float, body_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) with these limits (0: none)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)},
    )
