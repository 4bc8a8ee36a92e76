"""One chat sequence's output as ordered blocks (reasoning, text, tool calls), whole or as it streams.

The Messages and Responses APIs both answer with a list of typed parts (Anthropic's content blocks, the Responses
API's output items) where chat completions has one message. Both read the output the way chat completions does
(:class:`~service.tools.output_reader.OutputReader`, after the stop-sequence holdback); this module turns what the
reader hands out into blocks that open, grow and close in order, so each route only names its own events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from service.engine.requests import ErrorEvent, FinishEvent, TokenEvent
from service.engine.stop_matcher import StopHoldback
from service.http.admission import EngineStream, merged_events
from service.http.openai_apis.v1_common import chat_output_reader, final_text, read_chat_output
from service.schemas.openai_requests import ChatShape
from service.tools.call_parser import ToolCall
from service.tools.output_reader import OutputPiece

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    """One part of the answer; a tool call's ``text`` is its arguments' JSON text."""

    index: int
    kind: BlockKind
    text: str = ""
    call_id: str = ""
    name: str = ""

    def arguments(self) -> dict:
        """A tool call's arguments as an object (``{}`` when the model's text is no JSON object, e.g. cut short)."""
        try:
            value = json.loads(self.text or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass
class BlockEvent:
    """A block opened (``start``), grew by ``delta`` (``delta``) or closed (``stop``)."""

    kind: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


@dataclass
class OutputBlocks:
    """Blocks built from a sequence's pieces: a new kind of piece (or a new call) closes the open block."""

    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _calls: dict[int, Block] = field(default_factory=dict)

    def _switch(self, kind: BlockKind, out: list[BlockEvent], call_id: str = "", name: str = "") -> Block:
        if self._open is not None and self._open.kind == kind and kind != "tool_call":
            return self._open
        out.extend(self.close())
        block = Block(index=len(self.blocks), kind=kind, call_id=call_id, name=name)
        self.blocks.append(block)
        self._open = block
        out.append(BlockEvent("start", block))
        return block

    def _grow(self, block: Block, text: str, out: list[BlockEvent]) -> None:
        if text:
            block.text += text
            out.append(BlockEvent("delta", block, text))

    def take(self, piece: OutputPiece) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        if piece.reasoning:
            self._grow(self._switch("reasoning", out), piece.reasoning, out)
        if piece.content:
            self._grow(self._switch("text", out), piece.content, out)
        for delta in piece.calls:
            if delta.index not in self._calls:
                self._calls[delta.index] = self._switch("tool_call", out, delta.id or "", delta.name or "")
            self._grow(self._calls[delta.index], delta.arguments, out)
        return out

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)


def whole_blocks(final: FinishEvent, shape: ChatShape) -> tuple[list[Block], list[ToolCall]]:
    """A finished sequence's blocks, read as chat completions reads it (only calls whose arguments parse)."""
    reasoning, content, calls = read_chat_output(final, shape)
    blocks: list[Block] = []
    if reasoning:
        blocks.append(Block(index=len(blocks), kind="reasoning", text=reasoning))
    if content and (content.strip() or not calls):
        blocks.append(Block(index=len(blocks), kind="text", text=content))
    for call in calls:
        blocks.append(Block(index=len(blocks), kind="tool_call", text=call.arguments, call_id=call.id, name=call.name))
    return blocks, calls


def matched_stop(final: FinishEvent, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the sequence (``None`` unless one did)."""
    if final.stop_at is None:
        return None
    rest = final.text[final.stop_at :]
    return next((s for s in stops if rest.startswith(s)), None)


async def sequence_pieces(
    stream: EngineStream, shape: ChatShape
) -> AsyncIterator[OutputPiece | FinishEvent | ErrorEvent]:
    """One sequence's output as it comes: pieces read past the stop-sequence holdback, then its
    :class:`FinishEvent` (or an :class:`ErrorEvent`). Closes the stream (cancelling it) however the caller stops."""
    hold = StopHoldback(stream.request.stop)
    reader = chat_output_reader(shape)
    try:
        async for _, ev in merged_events([stream]):
            if isinstance(ev, ErrorEvent):
                stream.close()  # ended (merged_events marked it): free the slot before the caller answers
                yield ev
                return
            if not isinstance(ev, TokenEvent):
                continue
            if ev.final is None:
                text = hold.push(ev.text)
                if text:
                    yield reader.feed(text)
                continue
            # The last token carries the finish: the sequence is over, not cancelled (its own FinishEvent, still
            # queued, would have said so). Callers return on the FinishEvent without resuming this generator, whose
            # ``finally`` then runs only when it is collected: close the stream (free its slot) before handing it.
            stream.finished = True
            yield reader.feed(hold.finish(final_text(ev.final)), final=True)
            stream.close()
            yield ev.final
            return
    finally:
        stream.close()
