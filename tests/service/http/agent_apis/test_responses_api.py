"""``POST /v1/responses`` with the real ``openai`` client against a real server (a tiny random model with Qwen2.5's
Hermes template): a required or named ``tool_choice`` drives a function call through the grammar; greedy text
must equal /v1/chat/completions' for the same conversation; ``previous_response_id`` continues a stored one."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.models import chat_model_dir
from tests.service.conftest import LiveServer, settings_for
from tests.tool_schemas import TIME_TOOL, WEATHER_TOOL

WEATHER = {"type": "function"} | WEATHER_TOOL
TIME = {"type": "function"} | TIME_TOOL
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = settings_for(
        chat_model_dir("qwen25"), max_total_tokens=1024, max_input_tokens=768, responses_store_size=2
    )
    s = LiveServer(settings).start()
    yield s
    s.stop()


def _client(server: LiveServer):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _model(server: LiveServer) -> str:
    return _client(server).models.list().data[0].id


def test_required_tool_choice_gives_a_function_call_item(server) -> None:
    r = _client(server).responses.create(
        model=_model(server), input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=150
    )
    assert r.status == "completed", r
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0


def test_streamed_call_through_the_clients_stream_helper(server) -> None:
    with _client(server).responses.stream(
        model=_model(server),
        input=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=150,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = next(o for o in final.output if o.type == "function_call")
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("utc", "cet")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(numbers)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"


def test_greedy_text_equals_chat_completions_streamed_or_not(server) -> None:
    oa = _client(server)
    name = _model(server)
    r = oa.responses.create(model=name, input=ASK, instructions="Be brief.", max_output_tokens=8, temperature=0)
    chat = oa.chat.completions.create(
        model=name,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=8,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(
        oa.responses.create(
            model=name, input=ASK, instructions="Be brief.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == text


def test_previous_response_id_continues_the_conversation(server) -> None:
    oa = _client(server)
    name = _model(server)
    first = oa.responses.create(model=name, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=150)
    call = next(o for o in first.output if o.type == "function_call")
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = oa.responses.create(
        model=name, previous_response_id=first.id, input=follow, tools=[WEATHER], max_output_tokens=6, temperature=0
    )
    whole = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        *follow,
    ]
    direct = oa.responses.create(
        model=name, input=whole, tools=[WEATHER], max_output_tokens=6, temperature=0, store=False
    )
    echoed = [{"role": "user", "content": ASK}, *(o.model_dump(exclude_none=True) for o in first.output), *follow]
    fed_back = oa.responses.create(
        model=name, input=echoed, tools=[WEATHER], max_output_tokens=6, temperature=0, store=False
    )
    assert fed_back.output_text == direct.output_text  # output items sent back as input, as clients do
    assert second.previous_response_id == first.id
    assert second.output_text == direct.output_text and second.usage.input_tokens == direct.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as err:
        oa.responses.create(model=name, previous_response_id=direct.id, input="more", max_output_tokens=2)
    assert "previous_response_id" in str(err.value)


def test_the_store_is_bounded(server) -> None:
    oa = _client(server)
    name = _model(server)
    ids = [oa.responses.create(model=name, input="hi", max_output_tokens=1).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model=name, previous_response_id=ids[0], input="again", max_output_tokens=1)
    assert oa.responses.create(model=name, previous_response_id=ids[2], input="again", max_output_tokens=1).id


def test_refusals_name_what_is_not_built(server) -> None:
    url = server.url + "/v1/responses"
    cases = [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ]
    for body, word in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and word in error["message"], error
