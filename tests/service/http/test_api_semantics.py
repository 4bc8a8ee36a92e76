"""Issue 11's API semantics over a real socket, through the real clients: alternatives and prompt logprobs,
n/best_of, penalties, structured output, token-id prompts, /tokenize and /v1/models/{id}."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import text_generation
import torch
from transformers import AutoModelForCausalLM

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


@pytest.fixture()
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def tgi(server):
    return text_generation.Client(server.url, timeout=120)


@pytest.fixture(scope="module")
def plain_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_tgi_top_n_tokens_and_decoder_input_details(tgi, reference, plain_model) -> None:
    _, tok = reference
    out = tgi.generate("Hello there", max_new_tokens=5, top_n_tokens=3, decoder_input_details=True)
    d = out.details
    ids = tok("Hello there")["input_ids"]
    # prompt logprobs: the reference model's own log-softmax at each position
    assert [t.id for t in d.prefill] == ids and d.prefill[0].logprob is None
    with torch.no_grad():
        ref = torch.log_softmax(plain_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        assert d.prefill[pos].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
    assert len(d.top_tokens) == 5
    for token, top in zip(d.tokens, d.top_tokens):
        assert len(top) == 3 and top[0].id == token.id  # greedy: the chosen token is the likeliest
        assert top[0].logprob == pytest.approx(token.logprob, abs=1e-6)
        assert [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)


def test_tgi_top_n_tokens_are_streamed(tgi) -> None:
    events = list(tgi.generate_stream("Hello there", max_new_tokens=4, top_n_tokens=2))
    assert len(events) == 4
    assert all(len(e.top_tokens) == 2 and e.top_tokens[0].id == e.token.id for e in events)


def test_tgi_best_of_returns_the_likeliest_sequence(tgi) -> None:
    out = tgi.generate("Once", max_new_tokens=6, best_of=3, do_sample=True)  # the client refuses a seed here
    others = out.details.best_of_sequences
    assert len(others) == 2
    best = sum(t.logprob for t in out.details.tokens)
    assert all(best >= sum(t.logprob for t in o.tokens) for o in others)
    assert len({out.generated_text, *(o.generated_text for o in others)}) > 1  # three different samples


def test_frequency_and_presence_penalties_stop_repetition(client: httpx.Client, oa) -> None:
    def tgi_ids(params: dict) -> list[int]:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 16, "details": True, **params}}
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    plain = tgi_ids({})
    assert len(set(plain)) < len(plain)  # the tiny random model loops without a penalty
    penalised = tgi_ids({"frequency_penalty": 2.0})
    assert len(set(penalised)) == len(penalised)

    c = oa.completions.create(
        model="tiny-llama", prompt="Hello", max_tokens=16, temperature=0, presence_penalty=2.0, logprobs=0
    )
    tokens = c.choices[0].logprobs.tokens
    assert len(set(tokens)) == len(tokens)


def test_tgi_grammar_json_and_regex(tgi) -> None:
    from text_generation.types import Grammar, GrammarType

    out = tgi.generate("Answer:", max_new_tokens=80, grammar=Grammar(type=GrammarType.Json, value=SCHEMA))
    jsonschema.validate(json.loads(out.generated_text), SCHEMA)
    assert out.details.finish_reason == "eos_token"
    out = tgi.generate("Answer:", max_new_tokens=10, grammar=Grammar(type=GrammarType.Regex, value="(yes|no)!"))
    assert out.generated_text in ("yes!", "no!")


def test_inference_client_details_and_response_format(server, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import InferenceClient

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)  # ours go to 127.0.0.1 only
    hf = InferenceClient(model=server.url)
    out = hf.text_generation("Hello there", max_new_tokens=4, details=True, top_n_tokens=2, decoder_input_details=True)
    assert len(out.details.top_tokens) == 4 and all(len(t) == 2 for t in out.details.top_tokens)
    assert out.details.prefill[0].logprob is None and len(out.details.prefill) > 1
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    hf = InferenceClient(base_url=server.url)
    chat = hf.chat_completion([{"role": "user", "content": "Pick"}], max_tokens=80, response_format=fmt, seed=3)
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)


def test_openai_response_format_json_schema_and_json_object(oa) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for seed in (1, 2):
        chat = oa.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Pick"}],
            max_tokens=80,
            response_format=fmt,
            seed=seed,
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        assert chat.choices[0].finish_reason == "stop"
    c = oa.completions.create(
        model="tiny-llama",
        prompt="{",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if c.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(c.choices[0].text), dict)
    else:  # cut by max_tokens: still the start of one JSON object
        assert c.choices[0].text.startswith("{")


def test_openai_n_and_best_of(oa) -> None:
    chat = oa.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, seed=4
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    assert chat.usage.completion_tokens == 12

    c = oa.completions.create(model="tiny-llama", prompt="Once", max_tokens=5, n=2, best_of=3, seed=9, logprobs=0)
    assert [ch.index for ch in c.choices] == [0, 1]
    sums = [sum(ch.logprobs.token_logprobs) for ch in c.choices]
    assert sums == sorted(sums, reverse=True)
    assert c.usage.completion_tokens == 15  # best_of's discarded sequence was generated too

    chunks = list(
        oa.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, seed=4, stream=True
        )
    )
    texts = ["", ""]
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    first = oa.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, seed=4
    )
    assert texts == [c.message.content for c in first.choices]  # seeded: the stream gives the same two texts


def test_openai_top_logprobs_plain_and_streamed(oa) -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    chat = oa.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    stream = oa.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert all(len(e.top_logprobs) == 3 for e in streamed)

    c = oa.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    tops = c.choices[0].logprobs.top_logprobs
    assert len(tops) == 4 and all(1 <= len(t) <= 3 for t in tops)


def test_prompts_as_token_ids_and_lists(oa, reference) -> None:
    _, tok = reference
    ids = tok("Hello there")["input_ids"]
    by_text = (
        oa.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=6, temperature=0).choices[0].text
    )
    by_ids = oa.completions.create(model="tiny-llama", prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert by_ids == by_text
    once = oa.completions.create(model="tiny-llama", prompt="Once", max_tokens=6, temperature=0).choices[0].text
    many = oa.completions.create(model="tiny-llama", prompt=["Hello there", "Once"], max_tokens=6, temperature=0)
    assert [c.text for c in many.choices] == [by_text, once] and [c.index for c in many.choices] == [0, 1]
    nested = oa.completions.create(
        model="tiny-llama", prompt=[ids, tok("Once")["input_ids"]], max_tokens=6, temperature=0
    )
    assert [c.text for c in nested.choices] == [by_text, once]


def test_openai_temperature_defaults_to_one(oa) -> None:
    def text(**kw) -> str:
        return oa.completions.create(model="tiny-llama", prompt="Once", max_tokens=8, **kw).choices[0].text

    assert text(seed=5) == text(seed=5, temperature=1.0)
    greedy = text(temperature=0)
    assert any(text(seed=s) != greedy for s in range(1, 4))  # omitted temperature samples


def test_models_by_id_and_tokenize(oa, client: httpx.Client, reference) -> None:
    _, tok = reference
    assert oa.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-5")
    r = client.post("/tokenize", json={"inputs": "Hello there"})
    assert r.status_code == 200
    tokens = r.json()
    assert [t["id"] for t in tokens] == tok("Hello there")["input_ids"]
    assert "".join(t["text"] for t in tokens) == "Hello there"
    assert all("Hello there"[t["start"] : t["stop"]] == t["text"] for t in tokens)
    r = client.post("/tokenize", json={"inputs": "x", "parameters": {"truncate": 3}})
    assert r.status_code == 422 and "parameters" in r.json()["error"]


def test_tokenize_in_vllms_shape_and_detokenize(client: httpx.Client, server) -> None:
    """vLLM's {"prompt"} / {"messages"} beside TGI's {"inputs"}; /detokenize inverts it."""
    tgi = client.post("/tokenize", json={"inputs": "Hello there"}).json()
    r = client.post("/tokenize", json={"prompt": "Hello there"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [t["id"] for t in tgi] and body["count"] == len(tgi)
    assert body["max_model_len"] == server.settings.max_total_tokens
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    done = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == done["usage"]["prompt_tokens"]
    text = client.post("/detokenize", json={"tokens": body["tokens"][1:]}).json()
    assert text == {"prompt": "Hello there"}
    for bad in ({"prompt": "a", "inputs": "b"}, {}, {"prompt": ""}):
        r = client.post("/tokenize", json=bad)
        assert r.status_code == 422 and ("exactly one" in r.text or "empty" in r.text), r.text
    r = client.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 422 and "outside the vocabulary" in r.text
