"""The connection layer (issue 38), over raw sockets against a real uvicorn server: a connection that never sends a
whole request head, or whose body stops, is closed after the configured seconds (1 here); a request with both
``Content-Length`` and ``Transfer-Encoding`` is refused and its connection closed (RFC 9112 §6.1); a slow but live
client is served, and the server answers others all along."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import LiveServer, settings_for

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def strict(tiny_llama: Path) -> Iterator[LiveServer]:
    s = LiveServer(settings_for(tiny_llama, header_timeout=TIMEOUT_S, body_timeout=TIMEOUT_S)).start()
    yield s
    s.stop()


def _connect(server: LiveServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=15)
    return s


def _read_until_closed(s: socket.socket, limit_s: float = 15) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    s.settimeout(limit_s)
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - start


def _health_ok(server: LiveServer) -> None:
    t = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - t < 1.0


def test_an_idle_connection_is_closed(strict: LiveServer) -> None:
    with _connect(strict) as s:
        data, took = _read_until_closed(s)
    assert data == b"" and TIMEOUT_S * 0.8 <= took < TIMEOUT_S + 3


def test_trickled_headers_get_408_and_a_close(strict: LiveServer) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
    with _connect(strict) as s:
        start = time.monotonic()
        try:
            for byte in head:  # one byte every 0.1 s: the head as a whole is late, no single gap is long
                s.sendall(bytes([byte]))
                time.sleep(0.1)
                _health_ok(strict) if byte == ord("X") else None
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = _read_until_closed(s)
        took = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408"), data
    assert TIMEOUT_S * 0.8 <= took < TIMEOUT_S + 3


def test_a_body_that_stops_is_closed(strict: LiveServer) -> None:
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    with _connect(strict) as s:
        s.sendall(head + b'{"inputs": "')  # 12 of 1000 bytes, then nothing
        _health_ok(strict)
        data, took = _read_until_closed(s)
    assert b"200 OK" not in data and took < TIMEOUT_S + 3


def test_a_slow_body_that_keeps_coming_is_served(strict: LiveServer) -> None:
    body = b'{"inputs": "Hello", "parameters": {"max_new_tokens": 2}}'
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    with _connect(strict) as s:
        s.sendall(head)
        for i in range(0, len(body), 10):  # 6 pieces, 0.5 s apart: 3 s in all, never 1 s idle
            time.sleep(TIMEOUT_S / 2)
            s.sendall(body[i : i + 10])
        data, _ = _read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200"), data


@pytest.mark.parametrize(
    "lengths",
    [
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        b"content-length: 0\r\ntransfer-encoding: chunked\r\n",
    ],
)
def test_content_length_with_transfer_encoding_is_refused_and_closed(strict: LiveServer, lengths: bytes) -> None:
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    request = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + lengths + b"\r\n"
    request += b'3\r\n{"a\r\n0\r\n\r\n' + smuggled
    with _connect(strict) as s:
        s.sendall(request)
        data, took = _read_until_closed(s, limit_s=10)
    assert data.startswith(b"HTTP/1.1 400"), data
    assert data.count(b"HTTP/1.1") == 1  # the request after it was never read
    assert b"connection: close" in data.lower() and took < 5


def test_keep_alive_and_pipelining_still_work(strict: LiveServer) -> None:
    two = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with _connect(strict) as s:
        s.sendall(two)
        data, _ = _read_until_closed(s)
    assert data.count(b"HTTP/1.1 200") == 2
    with httpx.Client(base_url=strict.url) as c:  # one connection, requests further apart than the head timeout
        for _ in range(2):
            assert c.get("/health").status_code == 200
            time.sleep(TIMEOUT_S * 1.5)
            assert c.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
