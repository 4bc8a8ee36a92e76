"""The blocks the Messages and Responses APIs answer with: reasoning, then text, then each tool call, the same
whether the output is read whole or streamed a character at a time (so a stream's deltas add up to the answer)."""

from __future__ import annotations

import json

import pytest

from service.engine.requests import FinishEvent
from service.http.agent_apis.output_blocks import OutputBlocks, whole_blocks
from service.http.openai_apis.v1_common import chat_output_reader
from service.schemas.openai_requests import ChatShape
from service.tools.tool_requests import plan_tools

TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
OUTPUT = '<think>plan it</think>Sure.<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>'


def _shape(thinks: bool) -> ChatShape:
    return ChatShape(tools=plan_tools(TOOLS, "auto", None, None, "hermes"), prompt_text="", thinks=thinks)


def _final(text: str, reason: str = "eos_token") -> FinishEvent:
    return FinishEvent(reason=reason, text=text, generated_tokens=9, prompt_tokens=3, seed=None, tokens=[])


@pytest.mark.parametrize("thinks", [True, False])
def test_streamed_blocks_add_up_to_the_whole_ones(thinks: bool) -> None:
    whole, calls = whole_blocks(_final(OUTPUT), _shape(thinks))
    kinds = [b.kind for b in whole]
    assert kinds == (["reasoning", "text", "tool_call"] if thinks else ["text", "tool_call"])
    assert len(calls) == 1 and json.loads(whole[-1].text) == {"city": "Paris"} and whole[-1].name == "w"
    assert whole[-1].arguments() == {"city": "Paris"}

    reader, blocks, events = chat_output_reader(_shape(thinks)), OutputBlocks(), []
    for i, ch in enumerate(OUTPUT):
        events += blocks.take(reader.feed(ch, final=i == len(OUTPUT) - 1))
    events += blocks.close()
    assert [(b.kind, b.text, b.name) for b in blocks.blocks] == [(b.kind, b.text, b.name) for b in whole]
    assert blocks.blocks[-1].call_id == events[-1].block.call_id and blocks.has_calls
    # every block opens once, closes once, and closes before the next opens
    opened = [e.block.index for e in events if e.kind == "start"]
    closed = [e.block.index for e in events if e.kind == "stop"]
    assert opened == closed == list(range(len(whole)))
    for b in blocks.blocks:
        assert "".join(e.delta for e in events if e.block is b and e.kind == "delta") == b.text


def test_a_call_cut_by_the_token_limit_is_no_call() -> None:
    cut = OUTPUT[: OUTPUT.index("Paris")]
    blocks, calls = whole_blocks(_final(cut, "length"), _shape(True))
    assert not calls and [b.kind for b in blocks] == ["reasoning", "text"]
