"""Tool calls, reasoning and the new sampling fields on /v1/chat/completions, with the openai client and LangChain,
against real servers whose tiny random models carry chat templates shaped like Qwen2.5's, Qwen3's, Llama 3.1's,
Mistral's and gpt-oss's (harmony). Random weights write no calls of their own: ``tool_choice`` required or named
drives the output through the grammar, and the server must then parse what its template's format says."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.models import chat_model_dir
from tests.service.conftest import LiveServer, settings_for
from tests.tool_schemas import TIME_TOOL, WEATHER_TOOL

WEATHER = {"type": "function", "function": WEATHER_TOOL}
TIME = {"type": "function", "function": TIME_TOOL}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _serve(family: str, **kw) -> LiveServer:
    settings = settings_for(chat_model_dir(family), max_total_tokens=1024, max_input_tokens=768, **kw)
    return LiveServer(settings).start()


@pytest.fixture(scope="module", params=["qwen25", "llama31", "mistral", "harmony"])
def family_server(request) -> Iterator[tuple[str, LiveServer]]:
    server = _serve(request.param)
    yield request.param, server
    server.stop()


@pytest.fixture(scope="module")
def qwen3() -> Iterator[LiveServer]:
    server = _serve("qwen3", served_model_name="qwen3-tiny,alias-b")
    yield server
    server.stop()


def _client(server: LiveServer):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and args["unit"] in ("c", "f") and set(args) == {"city", "unit"}
    return args


def test_required_tool_choice_returns_parsed_calls(family_server) -> None:
    _, server = family_server
    oa = _client(server)
    chat = oa.chat.completions.create(
        model=oa.models.list().data[0].id, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=150
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1 and not choice.message.content
    _check_weather_call(choice.message.tool_calls[0])


def test_streamed_calls_through_the_clients_stream_helper(family_server) -> None:
    """The openai client's stream accumulator rebuilds the same call from OpenAI-shaped deltas; no call text leaks
    into content."""
    _, server = family_server
    oa = _client(server)
    with oa.chat.completions.stream(
        model=oa.models.list().data[0].id, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=150
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert not message.content
    _check_weather_call(message.tool_calls[0])
    assert not [e for e in events if e.type == "content.delta" and e.delta]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done and done[0].name == "get_weather" and done[0].arguments == message.tool_calls[0].function.arguments


def test_named_choice_picks_that_function_and_a_round_trip_works(family_server) -> None:
    family, server = family_server
    oa = _client(server)
    name = oa.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_time"}}
    chat = oa.chat.completions.create(
        model=name, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=150
    )
    call = chat.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    history = [*ASK, chat.choices[0].message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "12:00"})
    after = oa.chat.completions.create(model=name, messages=history, tools=[WEATHER, TIME], max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_template_without_tools_is_refused_with_the_reason(server) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required"},
        timeout=30,
    )
    assert r.status_code == 400 and "chat template takes no tools" in r.json()["error"]["message"]


def test_tools_empty_null_and_none_choice_are_consistent(server) -> None:
    for extra in ({"tools": []}, {"tools": None}, {"tool_choice": "none"}, {"tools": [WEATHER], "tool_choice": "none"}):
        r = httpx.post(
            server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **extra}, timeout=30
        )
        assert r.status_code == 200, (extra, r.text)
        assert "tool_calls" not in r.json()["choices"][0]["message"]


def test_langchain_bind_tools_and_structured_output(qwen3) -> None:
    import langchain_openai as lc
    from pydantic import BaseModel, Field

    llm = lc.ChatOpenAI(base_url=qwen3.url + "/v1", api_key="unused", model="qwen3-tiny", max_tokens=150, max_retries=0)
    reply = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert reply.tool_calls[0]["args"]["city"] in ("Paris", "Rome")

    class Answer(BaseModel):
        verdict: bool = Field(description="yes or no")

    for method in ("function_calling", "json_schema"):
        out = llm.with_structured_output(Answer, method=method).invoke("Is Paris in France?")
        assert isinstance(out, Answer)


def test_reasoning_is_split_from_content_also_streamed(qwen3) -> None:
    oa = _client(qwen3)
    fmt = {"type": "regex", "value": "<think>[a-z]{1,6}</think>[a-z]{1,6}"}
    chat = oa.chat.completions.create(model="alias-b", messages=ASK, max_tokens=40, response_format=fmt)
    message = chat.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and reasoning.isalpha() and message.content.isalpha()
    chunks = list(
        oa.chat.completions.create(model="alias-b", messages=ASK, max_tokens=40, response_format=fmt, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert streamed_reasoning.isalpha() and streamed_content.isalpha()
    assert "<think>" not in streamed_content and "</think>" not in streamed_reasoning


def test_enable_thinking_false_closes_the_block_in_the_prompt(qwen3) -> None:
    """With thinking off the template closes an empty block, so the prompt grows and nothing is reasoning."""
    body = {"model": "qwen3-tiny", "messages": ASK, "max_tokens": 3, "temperature": 0}
    on = httpx.post(qwen3.url + "/v1/chat/completions", json=body, timeout=30).json()
    off_body = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    off = httpx.post(qwen3.url + "/v1/chat/completions", json=off_body, timeout=30).json()
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    assert "reasoning_content" not in off["choices"][0]["message"]
    bad = httpx.post(qwen3.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": {"tools": []}})
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"]
