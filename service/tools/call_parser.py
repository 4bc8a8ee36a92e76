"""The shared interface of the tool-call parsers, and the incremental scanner the JSON formats use.

A model writes its tool calls as text in its family's format (:mod:`service.tools.hermes_format`,
:mod:`service.tools.llama3_format`, :mod:`service.tools.mistral_format`): a start marker, then JSON objects each
holding a function's ``name`` and its arguments. (Harmony names the function in a message header instead, and has its
own reader: :mod:`service.tools.harmony_format`.) One :class:`ToolCallParser` per sequence reads the output as it
comes: text before the marker is content (a marker's possible beginning is held back), everything after it is
tool-call text, scanned again on every piece (outputs are short) for objects whose name is complete and whose
arguments have grown. It hands out :class:`CallDelta`\\ s in OpenAI's streaming shape (index, id and name once,
then argument fragments). The same parser, fed the whole text at once, gives the non-streamed answer, so a
streamed answer's fragments always add up to the non-streamed ``arguments``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls: its start markers, whether the marker must open the output, what may
    stand between calls, and the key holding the arguments."""

    name: str
    markers: tuple[str, ...]
    at_start_only: bool = False
    args_keys: tuple[str, ...] = ("arguments",)
    #: Literal text before and after one call in the grammar that enforces ``tool_choice`` required/named.
    call_prefix: str = ""
    call_suffix: str = ""
    #: Whether the grammar's calls are a JSON array (Mistral) rather than one object.
    array: bool = False
    #: Whether a call's header names the function (harmony's ``to=functions.NAME``): ``call_prefix`` then holds
    #: ``{name}``, the JSON is the arguments alone, and the grammar has one prefix per tool.
    name_in_header: bool = False


@dataclass
class CallDelta:
    """One piece of a streamed tool call: ``id`` and ``name`` come once (with the call's first piece)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as the model wrote it

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class _Call:
    id: str
    name: str
    sent: int = 0  # characters of the arguments handed out
    complete: bool = False
    arguments: str = ""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Scan:
    """An object's scan: where it ends (``None`` while open) and, per top-level key, where its value lies."""

    end: int | None
    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)


def _string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string opening at ``start``, or ``None`` while it is open."""
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at ``start`` (whitespace skipped before), ``None`` while open."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            if depth == 0:
                return i
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return i  # the end of a bare value (a number, true): the enclosing object closes here
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and c == ",":
            return i
        i += 1
    return None


def scan_object(text: str, start: int) -> _Scan:
    """The top-level keys of the object opening at ``text[start] == "{"`` and where each value lies."""
    scan = _Scan(end=None)
    i = start + 1
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != '"':
            return scan  # not JSON: no keys to report past here
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = key_end
        while i < len(text) and text[i] in " \t\r\n:":
            i += 1
        if i >= len(text):
            return scan
        end = _value_end(text, i)
        scan.values[key] = (i, end)
        if end is None:
            return scan
        i = end
    return scan


class ToolCallParser:
    """One sequence's tool calls in ``fmt``, read incrementally; ``names`` (the request's tools) are the only
    calls taken, so that text that merely looks like a call in ``auto`` mode is not mistaken for one."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str] | None = None):
        self.fmt = fmt
        self.names = names
        self.calls: list[_Call] = []
        self._text = ""
        self._tool_at: int | None = None  # where tool-call text starts in _text
        self._content_sent = 0

    @property
    def in_tools(self) -> bool:
        return self._tool_at is not None

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """Take the next piece of output; return the content it frees and the tool-call pieces it completes."""
        self._text += piece
        content = ""
        if self._tool_at is None:
            content = self._content(final)
        deltas = self._scan_calls() if self._tool_at is not None else []
        return content, deltas

    def _content(self, final: bool) -> str:
        text, fmt = self._text, self.fmt
        for marker in fmt.markers:
            at = text.find(marker)
            if at >= 0 and (not fmt.at_start_only or not text[:at].strip()):
                self._tool_at = at  # the calls are the JSON objects from here on
                out = text[self._content_sent : at]
                self._content_sent = at
                return out if not fmt.at_start_only else ""
        keep = 0 if final else self._held_back()
        out = text[self._content_sent : len(text) - keep]
        self._content_sent = len(text) - keep
        return out

    def _held_back(self) -> int:
        """Characters at the end that may begin a marker (all of it, for a start-only marker not yet ruled out)."""
        text = self._text
        if self.fmt.at_start_only:
            stripped = text.lstrip()
            return len(text) if any(m.startswith(stripped) for m in self.fmt.markers) else 0
        for n in range(min(len(text), max(len(m) for m in self.fmt.markers) - 1), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.fmt.markers):
                return n
        return 0

    def _scan_calls(self) -> list[CallDelta]:
        text, i, found = self._text, self._tool_at or 0, 0
        deltas: list[CallDelta] = []
        while True:
            i = text.find("{", i)
            if i < 0:
                break
            scan = scan_object(text, i)
            delta = self._update(found, text, scan)
            if delta is None:
                break
            found += 1
            if delta.name is not None or delta.arguments:
                deltas.append(delta)
            if scan.end is None:
                break
            i = scan.end
        return deltas

    def _update(self, index: int, text: str, scan: _Scan) -> CallDelta | None:
        name_at = scan.values.get("name")
        if name_at is None or name_at[1] is None:
            return None
        try:
            name = json.loads(text[name_at[0] : name_at[1]])
        except json.JSONDecodeError:
            return None
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            return None
        delta = CallDelta(index=index)
        if index == len(self.calls):
            self.calls.append(_Call(id=new_call_id(), name=name))
            delta.id, delta.name = self.calls[index].id, name
        call = self.calls[index]
        args_at = next((scan.values[k] for k in self.fmt.args_keys if k in scan.values), None)
        if args_at is not None:
            start, end = args_at
            args = text[start : end if end is not None else len(text)].rstrip()
            call.arguments = args
            call.complete = end is not None
            delta.arguments = args[call.sent :]
            call.sent = len(args)
        return delta

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: the content still held back and the calls whose arguments are JSON. When no
        call could be read, all of the tool-call text is content after all (what the model wrote was no call)."""
        content, _ = self.feed("", final=True)
        calls = []
        for c in self.calls:
            try:
                json.loads(c.arguments or "{}")
            except json.JSONDecodeError:
                continue
            calls.append(ToolCall(id=c.id, name=c.name, arguments=c.arguments or "{}"))
        if not calls and self._tool_at is not None:
            content += self._text[self._content_sent :]
            self._content_sent = len(self._text)
        return content, calls


def parse_all(fmt: ToolFormat, text: str, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole output's content and tool calls (the non-streamed answer)."""
    parser = ToolCallParser(fmt, names)
    content, _ = parser.feed(text)
    rest, calls = parser.finish()
    return content + rest, calls
