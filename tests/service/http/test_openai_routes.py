"""OpenAI routes over a real socket, driven by the official ``openai`` client and by raw SSE parsing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


@pytest.fixture()
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(oa) -> None:
    models = oa.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]


def test_completion_equals_tgi_generate(oa, client: httpx.Client) -> None:
    tgi = client.post("/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 7}}).json()
    c = oa.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=7, temperature=0)
    assert c.object == "text_completion"
    assert c.choices[0].text == tgi["generated_text"]
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 7 and c.usage.total_tokens == c.usage.prompt_tokens + 7


def test_completion_logprobs_and_echo(oa) -> None:
    c = oa.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4, temperature=0, logprobs=0, echo=True)
    lp = c.choices[0].logprobs
    prompt_len = c.usage.prompt_tokens
    # echo: the prompt's tokens come first, the first with no logprob (nothing precedes it), then the 4 generated
    assert len(lp.tokens) == prompt_len + 4 and len(lp.token_logprobs) == prompt_len + 4
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert c.choices[0].text.startswith("Hello") and c.choices[0].text == "".join(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_completion_stream_concatenates_to_the_same_text(oa) -> None:
    whole = oa.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=9, temperature=0)
    chunks = list(
        oa.completions.create(
            model="tiny-llama",
            prompt="Hello there",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9


def test_chat_completion_uses_the_chat_template(oa, client: httpx.Client, tiny_llama) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a story."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat = oa.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])
    # same prompt through /v1/completions (tokenized with special tokens from the template text) gives same text
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 6


def test_chat_stream_role_then_content_then_done(server, oa) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        raw = r.read().decode()
    lines = [ln for ln in raw.split("\n\n") if ln.strip()]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = oa.chat.completions.create(model="tiny-llama", messages=body["messages"], max_tokens=5, temperature=0)
    assert streamed == whole.choices[0].message.content
    via_client = list(
        oa.chat.completions.create(
            model="tiny-llama", messages=body["messages"], max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in via_client) == streamed


def test_stop_sequences_are_cut_and_never_streamed(oa) -> None:
    whole = oa.completions.create(model="tiny-llama", prompt="Once", max_tokens=12, temperature=0).choices[0].text
    stop = whole[3:6]
    assert stop and stop in whole
    cut = oa.completions.create(model="tiny-llama", prompt="Once", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(
        oa.completions.create(model="tiny-llama", prompt="Once", max_tokens=12, temperature=0, stop=[stop], stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole[: whole.index(stop)]


def test_openai_client_gets_400_with_openai_error_shape(oa, server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model="tiny-llama", prompt="Hello", max_tokens=5, top_p=1.5)
    assert "top_p" in str(info.value)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny-llama", "messages": "nope"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "messages" in err["message"]


def test_an_unknown_model_is_404_model_not_found(oa) -> None:
    """As in vLLM: a model this server does not serve is a 404 (aliases and --accept-any-model: test_agent_fields)."""
    with pytest.raises(openai.NotFoundError) as caught:
        oa.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    err = caught.value.body
    assert err["type"] == "not_found_error" and err["code"] == "model_not_found" and "tiny-llama" in err["message"]
