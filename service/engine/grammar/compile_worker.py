"""One grammar compiler process: ``python -m service.engine.grammar.compile_worker FD``.

It speaks over the socket ``FD`` (a :class:`multiprocessing.connection.Connection`). The first message is the
served tokenizer's ``xgrammar.TokenizerInfo`` as JSON; the worker answers ``ready``. Then each message is a job,
JSON ``{"kind", "value"}``, answered by ``ok`` + the compiled grammar's ``serialize_json()`` or ``err`` + the
reason. It imports only xgrammar (never the server), and it ends when its parent does: the socket closes (EOF)
between jobs, and a watchdog thread sees the parent gone during a long compilation.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any


def _wrapped(xgrammar: Any, parts: dict[str, Any]) -> Any:
    """Literal text, a value of the schema, literal text (one alternative of a ``wrapped_json`` job)."""
    pieces = [xgrammar.Grammar.from_json_schema(json.dumps(parts["schema"]), any_whitespace=False)]
    if parts.get("prefix"):
        pieces.insert(0, xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['prefix'])}"))
    if parts.get("suffix"):
        pieces.append(xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(parts['suffix'])}"))
    return pieces[0] if len(pieces) == 1 else xgrammar.Grammar.concat(*pieces)


def compile_job(compiler: Any, kind: str, value: str) -> Any:
    """xgrammar's compilation of one job (the kinds of :class:`service.engine.structured_output.GrammarSpec`)."""
    import xgrammar

    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(value, any_whitespace=False)
    if kind == "wrapped_json":
        parts = json.loads(value)
        options = [_wrapped(xgrammar, part) for part in parts.get("options", [parts])]
        return compiler.compile_grammar(options[0] if len(options) == 1 else xgrammar.Grammar.union(*options))
    if kind == "ebnf":
        return compiler.compile_grammar(value)
    return compiler.compile_regex(value)


def reason(exc: Exception) -> str:
    """xgrammar's message, last line, without its ``[time] /source/file.cc:line:`` prefix (no internal paths)."""
    text = str(exc).strip()
    last = text.splitlines()[-1] if text else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", last)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)  # the server is gone: never outlive it, even mid-compilation


def serve(conn: Connection, parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # the server caches; a worker may be killed
    conn.send_bytes(b"ready")
    while True:
        try:
            job = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            answer = b"ok" + compile_job(compiler, job["kind"], job["value"]).serialize_json().encode()
        except Exception as exc:  # noqa: BLE001 - xgrammar's refusal of the schema goes back to the request
            answer = b"err" + reason(exc).encode()
        conn.send_bytes(answer)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
