"""One chat sequence's output read as reasoning, content and tool calls, piece by piece or whole.

The reasoning split (:mod:`service.tools.reasoning`) comes first: tool calls are looked for in the content only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.tools.call_parser import CallDelta, ToolCall, ToolCallParser, ToolFormat
from service.tools.reasoning import ReasoningSplitter, split_reasoning


@dataclass
class OutputPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class OutputReader:
    """Reads one sequence: ``thinks`` splits reasoning off; ``fmt`` (with the tools' ``names``) parses calls."""

    def __init__(
        self, prompt_text: str, thinks: bool, fmt: ToolFormat | None = None, names: frozenset[str] | None = None
    ):
        self._splitter = ReasoningSplitter(prompt_text) if thinks else None
        self._calls = ToolCallParser(fmt, names) if fmt is not None else None
        self.prompt_text = prompt_text

    def feed(self, piece: str, final: bool = False) -> OutputPiece:
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
        return self._calls.finish()[1] if self._calls is not None else []


def read_whole(
    text: str, prompt_text: str, thinks: bool, fmt: ToolFormat | None, names: frozenset[str] | None
) -> tuple[str | None, str, list[ToolCall]]:
    """A whole output's (reasoning or ``None``, content, tool calls)."""
    reasoning = None
    if thinks:
        reasoning, text = split_reasoning(prompt_text, text)
    if fmt is None:
        return reasoning, text, []
    parser = ToolCallParser(fmt, names)
    content, _ = parser.feed(text, final=True)
    rest, calls = parser.finish()
    return reasoning, content + rest, calls
