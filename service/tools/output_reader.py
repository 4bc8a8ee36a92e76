"""One chat sequence's output read as reasoning, content and tool calls, piece by piece or whole.

The reasoning split (:mod:`service.tools.reasoning`) comes first: tool calls are looked for in the content only.
Harmony output (gpt-oss) says in each message's header whether it is reasoning, content or a call, so one
:class:`~service.tools.harmony_format.HarmonyReader` reads all three, with or without tools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.tools.call_parser import CallDelta, ToolCall, ToolCallParser, ToolFormat
from service.tools.harmony_format import HarmonyReader, read_harmony
from service.tools.reasoning import ReasoningSplitter, split_reasoning


@dataclass
class OutputPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class OutputReader:
    """Reads one sequence: ``thinks`` splits reasoning off; ``fmt`` (with the tools' ``names``) parses calls;
    ``harmony`` reads gpt-oss's channels instead of both (without tools no call is taken)."""

    def __init__(
        self,
        prompt_text: str,
        thinks: bool,
        fmt: ToolFormat | None = None,
        names: frozenset[str] | None = None,
        harmony: bool = False,
    ):
        self._harmony = HarmonyReader(prompt_text, _taken(fmt, names)) if harmony else None
        self._splitter = ReasoningSplitter(prompt_text) if thinks and not harmony else None
        self._calls = ToolCallParser(fmt, names) if fmt is not None and not harmony else None
        self.prompt_text = prompt_text

    def feed(self, piece: str, final: bool = False) -> OutputPiece:
        if self._harmony is not None:
            return OutputPiece(*self._harmony.feed(piece, final))
        out = OutputPiece()
        text = piece
        if self._splitter is not None:
            out.reasoning, text = self._splitter.feed(piece, final)
        if self._calls is not None:
            out.content, out.calls = self._calls.feed(text, final)
            if final:
                rest, _ = self._calls.finish()
                out.content += rest
        else:
            out.content = text
        return out

    def calls(self) -> list[ToolCall]:
        """The calls read so far whose arguments are complete JSON (call after the last :meth:`feed`)."""
        if self._harmony is not None:
            return self._harmony.finished_calls()
        return self._calls.finish()[1] if self._calls is not None else []


def _taken(fmt: ToolFormat | None, names: frozenset[str] | None) -> frozenset[str] | None:
    """The calls a harmony reader takes: the tools' names, none without tools."""
    return names if fmt is not None else frozenset()


def read_whole(
    text: str,
    prompt_text: str,
    thinks: bool,
    fmt: ToolFormat | None,
    names: frozenset[str] | None,
    harmony: bool = False,
) -> tuple[str | None, str, list[ToolCall]]:
    """A whole output's (reasoning or ``None``, content, tool calls)."""
    if harmony:
        return read_harmony(text, prompt_text, _taken(fmt, names))
    reasoning = None
    if thinks:
        reasoning, text = split_reasoning(prompt_text, text)
    if fmt is None:
        return reasoning, text, []
    parser = ToolCallParser(fmt, names)
    content, _ = parser.feed(text, final=True)
    rest, calls = parser.finish()
    return reasoning, content + rest, calls
