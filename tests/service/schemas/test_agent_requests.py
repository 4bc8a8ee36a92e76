"""The Messages and Responses bodies rewritten as the chat request they mean: the one rendering every chat API
shares sees the same messages, whichever API the conversation came through."""

from __future__ import annotations

import json

import pytest

from service.errors import RequestValidationError
from service.schemas.anthropic_requests import MessagesRequest
from service.schemas.anthropic_requests import as_chat_request as messages_chat
from service.schemas.responses_requests import ResponsesRequest, input_items
from service.schemas.responses_requests import as_chat_request as responses_chat

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def _plain(chat) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_messages_blocks_become_chat_messages_in_order() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            "tools": [{"name": "w", "description": "d", "input_schema": SCHEMA}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"],
            "top_k": 5,
        }
    )
    chat = messages_chat(body)
    messages = _plain(chat)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "Be brief."
    call = messages[2]["tool_calls"][0]
    assert call["id"] == "t1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "t1"}
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": SCHEMA, "description": "d"}}]
    assert chat.stop == ["\n\n"] and chat.top_k == 5 and chat.max_tokens == 5


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tools"),
        ({"metadata": {"tenant": "x"}}, "metadata.tenant"),
        ({"thinking": {"type": "enabled"}}, "thinking"),
    ],
)
def test_messages_refusals_name_the_field(extra: dict, word: str) -> None:
    body = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}
    )
    with pytest.raises(RequestValidationError, match=word):
        messages_chat(body)


def test_responses_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "reasoning", "summary": []},
            ],
            "tools": [{"type": "function", "name": "w", "parameters": SCHEMA, "strict": True}],
            "tool_choice": {"type": "function", "name": "w"},
            "max_output_tokens": 7,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
        }
    )
    chat = responses_chat(body, input_items(body))
    messages = _plain(chat)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["content"] == "Checking." and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}} and chat.max_tokens == 7
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": SCHEMA}}]
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


def test_responses_ignore_eos_reaches_the_chat_request() -> None:
    """vLLM's ``ignore_eos`` (guidellm's fixed-length runs) is carried, not refused or dropped."""
    body = ResponsesRequest.model_validate({"input": "Hi", "max_output_tokens": 4, "ignore_eos": True})
    assert responses_chat(body, input_items(body)).ignore_eos is True
    plain = ResponsesRequest.model_validate({"input": "Hi", "max_output_tokens": 4})
    assert responses_chat(plain, input_items(plain)).ignore_eos is False
