"""gpt-oss's harmony format: the output is a run of messages, each a header and a body, and the header says where
the body goes::

    <|channel|>analysis<|message|>…reasoning…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>…answer…<|return|>

The prompt's generation prefix (``<|start|>assistant``) opens the first header. A body on the ``analysis`` channel
is reasoning; one addressed ``to=functions.NAME`` is that call's JSON arguments; any other body (``final``, and
``commentary`` with no recipient: a preamble meant for the user) is content. The function's name stands in the
header, not in the JSON, which is why this format has its own reader rather than
:class:`~service.tools.call_parser.ToolCallParser`. The recipient may stand in the role part (``<|start|>assistant
to=functions.x<|channel|>commentary json``, as templates render past calls) or after the channel (as gpt-oss writes
them); both are read. The markers are special tokens, so harmony requests keep special tokens' text; the engine
drops the token that ends the sequence (``<|call|>``, ``<|return|>``) itself.

Output that does not open with a header (bare JSON a ``response_format`` grammar wrote) is all content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from service.tools.call_parser import CallDelta, ToolCall, ToolFormat, new_call_id

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
FUNCTIONS = "functions."

HARMONY = ToolFormat(
    name="harmony",
    markers=(CHANNEL,),
    call_prefix=f"{CHANNEL}commentary to={FUNCTIONS}{{name}} {CONSTRAIN}json{MESSAGE}",
    name_in_header=True,
)

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_FIRST_WORD = re.compile(r"[^\s<]+")


def writes_harmony(template: str | None) -> bool:
    return bool(template) and CHANNEL in template  # type: ignore[operator]


@dataclass(frozen=True)
class Header:
    """What a message's header says: its channel and its recipient (``functions.NAME``; ``None`` for none)."""

    channel: str
    recipient: str | None

    @staticmethod
    def read(text: str) -> Header:
        after = text.split(CHANNEL, 1)[1] if CHANNEL in text else ""
        word = _FIRST_WORD.search(after)
        to = _RECIPIENT.search(text)
        return Header(channel=word.group(0) if word else "", recipient=to.group(1) if to else None)


def _held_back(text: str) -> int:
    """Characters at the end of ``text`` that may begin a marker (every marker opens with ``<|``)."""
    at = text.rfind("<", max(0, len(text) - max(map(len, MARKERS)) + 1))
    if at >= 0 and any(m.startswith(text[at:]) for m in MARKERS):
        return len(text) - at
    return 0


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else None


@dataclass
class _HarmonyCall:
    id: str
    name: str
    raw: str = ""  # the body as written so far
    sent: int = 0  # characters of the stripped body handed out

    @property
    def arguments(self) -> str:
        return self.raw.strip()


class HarmonyReader:
    """One sequence's harmony output, read piece by piece: :meth:`feed` hands out (reasoning, content, call
    deltas). ``names`` are the calls taken (``None``: any function); a body addressed to another recipient is
    content, so nothing the model wrote is lost. Markers split across pieces are held back until settled."""

    def __init__(self, prompt_text: str, names: frozenset[str] | None = None):
        self.names = names
        self.calls: list[_HarmonyCall] = []
        self.reasoned = False  # whether any analysis message was opened (whole answers report reasoning as None)
        self._buf = ""
        self._state = "first"  # first | header | body | between | plain
        self._dest: str | int = "content"  # "reasoning", "content" or the index of the call being written
        self._out: tuple[list[str], list[str], list[CallDelta]] = ([], [], [])
        tail = prompt_text.rsplit(START, 1)[1] if START in prompt_text else ""
        if MESSAGE in tail and _first_marker(tail, ENDS) is None:
            self._open(tail.split(MESSAGE, 1)[0])  # the prompt wrote the header already (a prefilled channel)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str, list[CallDelta]]:
        """Take the next piece; return the reasoning and content it frees and the call deltas it completes."""
        self._buf += piece
        while self._step(final):
            pass
        reasoning, content, deltas = self._out
        self._out = ([], [], [])
        return "".join(reasoning), "".join(content), deltas

    def _step(self, final: bool) -> bool:
        """Read as far as the buffer allows in the current state; ``True`` when the state changed (read on)."""
        buf = self._buf
        if self._state == "first":
            return self._first(final)
        if self._state == "plain":
            self._emit("content", buf)
            self._buf = ""
            return False
        if self._state == "header":
            if MESSAGE not in buf:
                return False  # a header is short: wait for all of it
            header, self._buf = buf.split(MESSAGE, 1)
            self._open(header)
            return True
        if self._state == "between":
            at = buf.find(START)
            if at < 0:
                self._buf = buf[len(buf) - _held_back(buf) :]  # nothing but markers belongs between messages
                return False
            self._buf, self._state = buf[at + len(START) :], "header"
            return True
        return self._body(final)

    def _first(self, final: bool) -> bool:
        """The output's opening decides: a header (``<|channel|>``, or a recipient first), a new message
        (``<|start|>``), or plain content."""
        buf = self._buf
        for opening, state in ((CHANNEL, "header"), (" to=", "header"), ("to=", "header"), (START, "between")):
            if buf.startswith(opening):
                self._state = state
                return True
            if opening.startswith(buf) and not final:
                return False
        self._state = "plain"
        return True

    def _body(self, final: bool) -> bool:
        buf = self._buf
        found = _first_marker(buf, (*ENDS, START))
        if found is None:
            keep = 0 if final else _held_back(buf)
            self._emit(self._dest, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        at, marker = found
        self._emit(self._dest, buf[:at])
        self._buf = buf[at:] if marker == START else buf[at + len(marker) :]
        self._state = "between"
        return True

    def _open(self, header_text: str) -> None:
        """A header is complete: choose where its body goes (a call's name is handed out now)."""
        header = Header.read(header_text)
        self._state = "body"
        name = header.recipient[len(FUNCTIONS) :] if (header.recipient or "").startswith(FUNCTIONS) else None
        if name and (self.names is None or name in self.names):
            self.calls.append(_HarmonyCall(id=new_call_id(), name=name))
            self._dest = len(self.calls) - 1
            self._out[2].append(CallDelta(index=self._dest, id=self.calls[-1].id, name=name))
        elif header.channel == "analysis":
            self._dest, self.reasoned = "reasoning", True
        else:
            self._dest = "content"

    def _emit(self, dest: str | int, text: str) -> None:
        if not text:
            return
        if dest == "reasoning":
            self._out[0].append(text)
        elif dest == "content":
            self._out[1].append(text)
        else:
            call = self.calls[int(dest)]
            call.raw += text
            fragment = call.arguments[call.sent :]  # leading and trailing whitespace wait: fragments add up
            call.sent += len(fragment)
            if fragment:
                self._out[2].append(CallDelta(index=int(dest), arguments=fragment))

    def finished_calls(self) -> list[ToolCall]:
        """The calls whose arguments are JSON (call after the last :meth:`feed`, ``final=True``)."""
        out = []
        for c in self.calls:
            try:
                json.loads(c.arguments or "{}")
            except json.JSONDecodeError:
                continue
            out.append(ToolCall(id=c.id, name=c.name, arguments=c.arguments or "{}"))
        return out


def read_harmony(text: str, prompt_text: str, names: frozenset[str] | None) -> tuple[str | None, str, list[ToolCall]]:
    """A whole harmony output's (reasoning or ``None``, content, tool calls)."""
    reader = HarmonyReader(prompt_text, names)
    reasoning, content, _ = reader.feed(text, final=True)
    return (reasoning if reader.reasoned else None), content, reader.finished_calls()
