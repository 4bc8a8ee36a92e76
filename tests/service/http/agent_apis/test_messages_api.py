"""``POST /v1/messages`` with the real ``anthropic`` client against a real server: tiny random models whose chat
templates write Hermes (Qwen2.5's), Llama 3.1's JSON, Mistral's [TOOL_CALLS] and gpt-oss's harmony calls.
``tool_choice`` any or tool drives the output through the grammar. The 2.x client no longer sends temperature,
top_p or top_k (Anthropic deprecated them), so tests pass them as ``extra_body``; the server takes them. Greedy
text must equal /v1/chat/completions' for the same conversation."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from tests.models import chat_model_dir
from tests.service.conftest import LiveServer, settings_for
from tests.tool_schemas import TIME_TOOL, WEATHER_TOOL

KEY = "sk-test-messages"


def _anthropic(tool: dict) -> dict:
    """A function tool in Anthropic's shape: its parameters are the ``input_schema``."""
    shaped = {k: v for k, v in tool.items() if k != "parameters"}
    return shaped | {"input_schema": tool["parameters"]}


WEATHER = _anthropic(WEATHER_TOOL)
TIME = _anthropic(TIME_TOOL)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["qwen25", "llama31", "mistral", "harmony"])
def server(request) -> Iterator[LiveServer]:
    settings = settings_for(
        chat_model_dir(request.param),
        max_total_tokens=1024,
        max_input_tokens=768,
        api_key=[KEY],
        served_model_name="tiny",
    )
    s = LiveServer(settings).start()
    yield s
    s.stop()


def _client(server: LiveServer):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _check_call(block) -> None:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_any_tool_choice_gives_tool_use_blocks(server) -> None:
    msg = _client(server).messages.create(
        model="tiny", max_tokens=150, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert msg.stop_reason == "tool_use", msg
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert len(calls) == 1
    _check_call(calls[0])
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0


def test_streamed_tool_use_through_the_clients_accumulator(server) -> None:
    with _client(server).messages.stream(
        model="tiny", max_tokens=150, messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "any"}
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    calls = [b for b in final.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")
    if calls[0].name == "get_weather":
        _check_call(calls[0])
    assert kinds[0] == "message_start" and "content_block_start" in kinds and kinds[-1] == "message_stop"
    assert not [b for b in final.content if b.type == "text" and b.text.strip()]


def test_named_tool_and_a_tool_result_round_trip(server) -> None:
    client = _client(server)
    msg = client.messages.create(
        model="tiny",
        max_tokens=150,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time"},
    )
    call = next(b for b in msg.content if b.type == "tool_use")
    assert call.name == "get_time" and call.input.get("zone") in ("utc", "cet")
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]},
    ]
    after = client.messages.create(
        model="tiny", max_tokens=4, messages=history, tools=[WEATHER, TIME], extra_body={"temperature": 0}
    )
    assert after.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_greedy_text_equals_chat_completions_and_stop_reasons(server) -> None:
    client = _client(server)
    msg = client.messages.create(
        model="tiny", max_tokens=8, system="Be brief.", messages=ASK, extra_body={"temperature": 0, "top_k": 1}
    )
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": [{"role": "system", "content": "Be brief."}, *ASK], "max_tokens": 8, "temperature": 0},
        timeout=60,
    ).json()
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == chat["choices"][0]["message"]["content"]
    assert msg.stop_reason == ("max_tokens" if chat["choices"][0]["finish_reason"] == "length" else "end_turn")
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    with client.messages.stream(
        model="tiny", max_tokens=8, system="Be brief.", messages=ASK, extra_body={"temperature": 0}
    ) as s:
        streamed = s.get_final_message()
    assert "".join(b.text for b in streamed.content if b.type == "text") == text
    assert streamed.stop_reason == msg.stop_reason and streamed.usage.output_tokens == msg.usage.output_tokens
    if len(text) > 2:  # a stop sequence taken from the greedy text itself ends it there
        stop = text[1:3]
        cut = client.messages.create(
            model="tiny",
            max_tokens=8,
            system="Be brief.",
            messages=ASK,
            stop_sequences=[stop],
            extra_body={"temperature": 0},
        )
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert "".join(b.text for b in cut.content if b.type == "text") == text[: text.index(stop)]


def test_errors_in_anthropics_shape(server) -> None:
    url = server.url + "/v1/messages"
    good = {"model": "tiny", "max_tokens": 4, "messages": ASK}
    r = httpx.post(url, json=good, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    h = {"x-api-key": KEY}
    cases = [
        ({k: v for k, v in good.items() if k != "max_tokens"}, 400, "max_tokens"),
        ({**good, "thinking": {"type": "enabled", "budget_tokens": 10}}, 400, "thinking"),
        ({**good, "model": "other"}, 404, "other"),
        ({**good, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tools"),
        ({**good, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
        ({**good, "temperature": 1.5}, 400, "temperature"),
    ]
    for body, status, word in cases:
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == status, (body, r.text)
        data = r.json()
        assert data["type"] == "error" and word in data["error"]["message"], data
        assert data["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):
        _client(server).messages.create(model="tiny", max_tokens=4, messages=[])
