"""Text that reaches a log line or a client from a request or an internal error, made safe to write.

- :func:`printable` escapes every control character (CR and LF first of all) and Unicode's own line breaks, so a
  string from a request can never start a line of its own in the log: one record is one line.
- :class:`SafeFormatter` applies it to every record the server writes (the message, and the message of a logged
  exception; a traceback's own frame lines stay as Python writes them), whatever logger it came from.
- :func:`public_message` takes out of an error sent to a client what only the operator should see: source paths,
  file-system paths and peer addresses (a pipeline's ``[pair.cc:598] Connection closed by peer 10.0.0.2:29500``).
  The log keeps the full text.
"""

from __future__ import annotations

import logging
import re
import traceback

#: Every C0 control, DEL, the C1 controls, and Unicode's line and paragraph separators: written as escapes.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def printable(text: object) -> str:
    """``text`` on one line: control characters and line separators escaped (``\\n``, ``\\r``, ``\\x1b``...)."""
    return str(text).translate(_ESCAPES)


class SafeFormatter(logging.Formatter):
    """A formatter whose every record stays on its line: the message and an exception's message are escaped.

    A traceback's frame lines are Python's own; only the exception's text (which may quote a request) is escaped,
    so that no text a client sent can forge a record of its own."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: N802, ANN001 - logging's name and argument
        try:
            te = traceback.TracebackException(*ei)
            _escape_chain(te, set())
            return "".join(te.format()).rstrip("\n")
        except Exception:  # noqa: BLE001 - a formatter must never fail the record
            return printable(super().formatException(ei))


def _escape_chain(te: traceback.TracebackException, seen: set[int]) -> None:
    if id(te) in seen:
        return
    seen.add(id(te))
    if isinstance(getattr(te, "_str", None), str):
        te._str = printable(te._str)  # noqa: SLF001 - the exception's text, as format() writes it
    for linked in (te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())):
        if linked is not None:
            _escape_chain(linked, seen)


def install(level: int | str = logging.INFO, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    """Configure the root logger (as ``logging.basicConfig`` would) with a :class:`SafeFormatter` on every handler."""
    logging.basicConfig(level=level, format=fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(SafeFormatter(fmt))


_SOURCE = re.compile(r"\[?(?:[\w.~-]*/)*[\w.-]+\.(?:cc|cpp|cxx|c|h|hpp|cu|py|pyx)\b(?::\d+)?\]?")
_IPV4_PEER = re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\b\]?(?::\d+)?")
_IPV6_PEER = re.compile(r"\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\](?::\d+)?")
_HOST_PORT = re.compile(r"\b(?:localhost|[A-Za-z][\w-]*(?:\.[\w-]+)+):\d{2,5}\b")
_PATH = re.compile(r"(?<![\w.])(?:~|\.{1,2})?(?:/[\w.@+-]+){2,}/?")


def public_message(text: str) -> str:
    """``text`` for a client: source locations, file paths and peer addresses replaced by placeholders."""
    text = _SOURCE.sub("<source>", text)
    text = _IPV6_PEER.sub("<peer>", text)
    text = _IPV4_PEER.sub("<peer>", text)
    text = _HOST_PORT.sub("<peer>", text)
    text = _PATH.sub("<path>", text)
    return printable(text)
