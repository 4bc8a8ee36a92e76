"""gpt-oss's harmony output read into reasoning, content and tool calls: whole, and streamed split at every
character boundary (the markers are special tokens, but their text may still arrive in pieces), with the same
answer both ways."""

from __future__ import annotations

import json

import pytest

from service.tools.harmony_format import HARMONY, HarmonyReader, Header, read_harmony
from service.tools.output_reader import OutputReader, read_whole
from service.tools.tool_requests import call_grammar, plan_tools, tool_format
from tests.chat_templates import GPT_OSS, QWEN25
from tests.tool_schemas import TIME_TOOL, WEATHER_TOOL

PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
NAMES = frozenset({"get_weather", "get_time"})
THINK = "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"


def _streamed(text: str, pieces: list[str], names=NAMES) -> tuple[str, str, list[dict]]:
    """Feed ``pieces``; rebuild the calls from their deltas as a client's stream accumulator does."""
    reader = HarmonyReader(PROMPT, names)
    reasoning = content = ""
    calls: list[dict] = []
    for i, piece in enumerate(pieces):
        r, c, deltas = reader.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            if d.index == len(calls):
                assert d.id and d.name, "a call's first delta carries its id and name"
                calls.append({"id": d.id, "name": d.name, "arguments": ""})
            else:
                assert d.id is None and d.name is None, "id and name come once"
            calls[d.index]["arguments"] += d.arguments
    assert "".join(pieces) == text
    return reasoning, content, calls


def _splits(text: str):
    yield [text]
    yield list(text)  # one character a piece
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]


@pytest.mark.parametrize(
    "text, want",
    [
        (THINK + CALL, ("Need the weather tool.", "", [("get_weather", '{"city":"Paris"}')])),
        (THINK + FINAL, ("Need the weather tool.", "It is sunny.", [])),
        ("<|channel|>final<|message|>Hi <there>!", (None, "Hi <there>!", [])),
        (CALL.removeprefix("<|start|>assistant") + "<|call|>", (None, "", [("get_weather", '{"city":"Paris"}')])),
        ('{"a": 1}', (None, '{"a": 1}', [])),  # no header: bare output (a response_format grammar's) is content
        (
            THINK + '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|> {"zone":"utc"} ',
            ("Need the weather tool.", "", [("get_time", '{"zone":"utc"}')]),
        ),
        (
            "<|channel|>commentary<|message|>Checking.<|end|>" + CALL + "<|call|>",
            (None, "Checking.", [("get_weather", '{"city":"Paris"}')]),
        ),
    ],
)
def test_whole_and_streamed_give_the_same_answer(text, want) -> None:
    reasoning, content, calls = read_harmony(text, PROMPT, NAMES)
    assert (reasoning, content, [(c.name, c.arguments) for c in calls]) == want
    for pieces in _splits(text):
        r, c, streamed = _streamed(text, pieces)
        assert (r, c) == (want[0] or "", want[1]), pieces
        assert [(s["name"], s["arguments"]) for s in streamed] == want[2], pieces
        assert "<|" not in r + c, pieces


def test_several_calls_take_their_own_indexes_and_ids() -> None:
    second = '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone":"cet"}'
    text = CALL + "<|call|>" + second
    _, content, calls = read_harmony(text, PROMPT, NAMES)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].id != calls[1].id
    _, _, streamed = _streamed(text, list(text))
    assert [json.loads(s["arguments"]) for s in streamed] == [{"city": "Paris"}, {"zone": "cet"}]


def test_a_call_to_an_undeclared_function_is_content_not_a_call() -> None:
    _, content, calls = read_harmony(CALL, PROMPT, frozenset({"get_time"}))
    assert calls == [] and content == '{"city":"Paris"}'
    _, content, calls = read_harmony(CALL, PROMPT, frozenset())  # no tools sent: no calls taken
    assert calls == [] and content == '{"city":"Paris"}'


def test_arguments_cut_short_are_no_call() -> None:
    reader = HarmonyReader(PROMPT, NAMES)
    reader.feed(CALL[:-3], final=True)
    assert reader.calls and reader.finished_calls() == []


def test_a_prompt_that_opened_the_final_channel_already() -> None:
    reader = HarmonyReader(PROMPT + "<|channel|>final<|message|>", NAMES)
    assert reader.feed("Sunny.", final=True) == ("", "Sunny.", [])


def test_header_reads_the_recipient_where_it_stands() -> None:
    assert Header.read("<|channel|>commentary to=functions.f <|constrain|>json") == Header("commentary", "functions.f")
    assert Header.read("assistant to=functions.f<|channel|>commentary json") == Header("commentary", "functions.f")
    assert Header.read("assistant<|channel|>final") == Header("final", None)


def test_output_reader_and_read_whole_delegate_to_harmony() -> None:
    tools = plan_tools([{"type": "function", "function": WEATHER_TOOL}], "auto", None, GPT_OSS, None)
    assert tools is not None and tools.fmt is HARMONY
    text = THINK + CALL
    assert read_whole(text, PROMPT, False, tools.fmt, tools.names, harmony=True)[0] == "Need the weather tool."
    reader = OutputReader(PROMPT, False, tools.fmt, tools.names, harmony=True)
    piece = reader.feed(text, final=True)
    assert piece.reasoning == "Need the weather tool." and piece.content == "" and piece.calls
    assert [c.name for c in reader.calls()] == ["get_weather"]
    plain = OutputReader(PROMPT, False, None, None, harmony=True)  # no tools: reasoning still split off
    assert plain.feed(THINK + FINAL, final=True).content == "It is sunny."


def test_the_template_or_the_flag_chooses_harmony() -> None:
    assert tool_format(GPT_OSS) is HARMONY
    assert tool_format(QWEN25, "harmony") is HARMONY
    assert tool_format(GPT_OSS, "hermes").name == "hermes"


def test_the_grammar_has_one_header_per_tool_with_its_own_schema() -> None:
    tools = [{"type": "function", "function": t} for t in (WEATHER_TOOL, TIME_TOOL)]
    spec = call_grammar(HARMONY, tools)
    options = json.loads(spec.value)["options"]
    assert spec.kind == "wrapped_json" and spec.field == "tool_choice"
    assert [o["prefix"] for o in options] == [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>",
    ]
    assert options[0]["schema"] == WEATHER_TOOL["parameters"] and options[1]["schema"] == TIME_TOOL["parameters"]
