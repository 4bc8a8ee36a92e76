"""gpt-oss's harmony channels on /v1/chat/completions, against a real server whose tiny model's tokenizer holds
harmony's markers as special tokens and whose template is shaped like gpt-oss's. A regex drives the random model
through an analysis message and then a final one: the analysis is ``reasoning_content``, the final answer is
``content``, whole and streamed, and no marker reaches either. The Responses API reads a harmony call into a
function-call item. (Tool calls in harmony also run through the shared tests of every format,
:mod:`tests.service.http.test_tool_calls` and the Messages API's.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.models import harmony_model_dir
from tests.service.conftest import LiveServer, settings_for

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
#: An analysis message, then a final one, as gpt-oss writes them after the prompt's ``<|start|>assistant``.
CHANNELS = r"<\|channel\|>analysis<\|message\|>[a-z]{1,6}<\|end\|><\|start\|>assistant<\|channel\|>final<\|message\|>[a-z]{1,6}"


#: Room for the longest text the regex allows even when the random model spells the markers one character a token
#: (xgrammar matches characters: about 130 of them), so every answer ends by the grammar, not by the limit.
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def harmony() -> Iterator[LiveServer]:
    settings = settings_for(harmony_model_dir(), max_total_tokens=1024, max_input_tokens=768, served_model_name="oss")
    server = LiveServer(settings).start()
    yield server
    server.stop()


def _client(server: LiveServer):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_analysis_is_reasoning_and_final_is_content_also_streamed(harmony) -> None:
    oa = _client(harmony)
    fmt = {"type": "regex", "value": CHANNELS}
    chat = oa.chat.completions.create(model="oss", messages=ASK, max_tokens=MAX_TOKENS, response_format=fmt)
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "stop", chat
    assert message.model_extra["reasoning_content"].isalpha() and message.content.isalpha()
    chunks = list(
        oa.chat.completions.create(model="oss", messages=ASK, max_tokens=MAX_TOKENS, response_format=fmt, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning.isalpha() and content.isalpha()


def test_reasoning_effort_reaches_the_template(harmony) -> None:
    """gpt-oss's template writes ``Reasoning: <effort>`` into its system message: the server's prompt is the
    template's rendering with that effort, token for token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(harmony_model_dir())
    oa = _client(harmony)
    for effort in ("low", "high"):
        chat = oa.chat.completions.create(model="oss", messages=ASK, max_tokens=1, reasoning_effort=effort)
        prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, reasoning_effort=effort)
        assert f"Reasoning: {effort}" in prompt
        assert chat.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])


def test_responses_api_streams_a_harmony_call_as_a_function_call_item(harmony) -> None:
    """The Responses API reads harmony as chat completions does: the call's header names it, its body is the
    arguments, and no marker becomes output text."""
    from tests.tool_schemas import TIME_TOOL, WEATHER_TOOL

    tools = [{"type": "function"} | WEATHER_TOOL, {"type": "function"} | TIME_TOOL]
    with _client(harmony).responses.stream(
        model="oss", input=ASK[0]["content"], tools=tools, tool_choice="required", max_output_tokens=150
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time"), final.output
    assert json.loads(calls[0].arguments)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments
    assert not [e for e in events if e.type == "response.output_text.delta" and e.delta]
