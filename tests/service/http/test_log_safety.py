"""Logs no client can forge and that hold no secret (issue 38): a real ``loadmaster serve`` process, requests whose
parameter names, message keys and headers carry CR/LF and fake log lines, and the process's own output read back.

Every line the server writes must be one of its records (a timestamp and a level first) or a traceback's; the API
key never appears; a non-ASCII ``X-Request-Id`` is replaced whole; client errors carry no paths or peers."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.log_text import SafeFormatter, printable, public_message
from tests.service.cli.test_cli_serve import REPO, _env, _wait_ready
from tests.service.conftest import free_port

KEY = "sup3r-s3cret-key-value"
FAKE = "2030-01-01 00:00:00,000 INFO service: FORGED admin logged in"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("log-safety") / "server.log"
    argv = [sys.executable, "-m", "service.cli", "serve", str(tiny_llama), "--port", str(port), "--api-key", KEY]
    argv += ["--max-memory", "cpu=4GiB", "--max-total-tokens", "512", "--max-input-tokens", "256"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log, timeout=300, poll=0.2)
        yield url, port, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def _post(url: str, route: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(url + route, json=body, headers={"Authorization": f"Bearer {KEY}", **headers}, timeout=60)


def test_request_strings_never_forge_a_log_line_and_the_key_is_never_printed(served) -> None:
    url, port, proc, log = served
    evil = "x\r\n" + FAKE + "\n"
    cases = [
        ("/generate", {"inputs": "Hi", "parameters": {evil: 1}}),
        ("/generate", {"inputs": "Hi", evil: 1}),
        ("/v1/completions", {"prompt": "Hi", evil: 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", evil: 1}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {evil: 1}},
        ),
        ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": evil}}),
    ]
    for route, body in cases:
        r = _post(url, route, body)
        assert 400 <= r.status_code < 500, (route, r.text)
    r = httpx.post(url + "/generate", json={"inputs": "Hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    text = log.read_text()
    assert KEY not in text
    assert "Bearer <your key>" in text
    assert "Unsupported parameter(s)" in text  # the refusals were logged, escaped
    forged = [line for line in text.splitlines() if "FORGED" in line]
    assert len(forged) >= 5, text
    for line in forged:  # each inside the one record that quotes it, escaped; never a line of its own
        assert RECORD.match(line) and not line.startswith(FAKE[:10]) and "\\n" + FAKE in line, line


def _raw_request(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_a_non_ascii_request_id_is_replaced_not_mangled(server) -> None:
    port = server.port
    for sent in ("caf\xe9-1".encode("latin-1"), "id-\u00e9\u4e2d".encode(), b"has space", b"x" * 65):
        head = _raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + sent + b"\r\n\r\n")
        echoed = re.search(rb"(?im)^x-request-id: (.*?)\r$", head).group(1)
        assert re.fullmatch(rb"[0-9a-f]{16}", echoed), (sent, echoed)
    head = _raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: plain.id-1_2\r\n\r\n")
    assert b"x-request-id: plain.id-1_2\r\n" in head.lower()


def test_the_formatter_keeps_every_record_on_its_line() -> None:
    formatter = SafeFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "refused: %s", ("a\nINFO forged\r\x1b[2J",), None)
    assert formatter.format(record) == "INFO refused: a\\nINFO forged\\r\\x1b[2J"
    try:
        raise ValueError("bad\n" + FAKE)
    except ValueError:
        record = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    lines = formatter.format(record).splitlines()
    assert lines[0] == "ERROR failed" and lines[1].startswith("Traceback")
    assert lines[-1] == "ValueError: bad\\n" + FAKE
    assert printable("\u2028\u2029\x85\x7f") == "\\u2028\\u2029\\x85\\x7f"


def test_errors_for_clients_carry_no_paths_or_peers() -> None:
    gloo = (
        "pipeline rank 1 stopped receiving ([/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
        "closed by peer [10.0.0.7]:29500); restart the group"
    )
    out = public_message(gloo)
    assert "pair.cc" not in out and "10.0.0.7" not in out and "29500" not in out and "/pytorch" not in out
    assert out.startswith("pipeline rank 1 stopped receiving") and "restart the group" in out
    out = public_message("reading /srv/models/m/model-00001.safetensors from node-3.cluster.local:8080 or [fe80::1]:9")
    assert "/srv" not in out and "node-3" not in out and "fe80" not in out
