"""TGI's own Python client (``text-generation``) against a real server, unchanged: generate, stream, errors.

``text-generation`` 0.7 declares ``huggingface-hub<1`` but uses nothing that transformers 5's hub lacks, so
``scripts/setup`` installs it with ``--no-deps`` (its other needs, pydantic and aiohttp, are in the test extra).
"""

from __future__ import annotations

import asyncio

import pytest
import text_generation
import text_generation.errors


def test_generate_with_details(server, reference) -> None:
    greedy, tok = reference
    client = text_generation.Client(server.url, timeout=60)
    out = client.generate("The old lighthouse keeper", max_new_tokens=8)
    assert [t.id for t in out.details.tokens] == greedy("The old lighthouse keeper", 8)
    assert out.generated_text == tok.decode([t.id for t in out.details.tokens], skip_special_tokens=True)
    assert out.details.generated_tokens == 8
    assert out.details.finish_reason.value == "length"
    assert all(t.logprob <= 0 for t in out.details.tokens)


def test_generate_stream_matches_generate(server) -> None:
    client = text_generation.Client(server.url, timeout=60)
    whole = client.generate("Once upon a time", max_new_tokens=6)
    events = list(client.generate_stream("Once upon a time", max_new_tokens=6))
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == whole.generated_text
    assert events[-1].details.finish_reason.value == "length" and events[-1].details.generated_tokens == 6


def test_sampling_parameters_and_stop_sequences(server) -> None:
    client = text_generation.Client(server.url, timeout=60)
    a = client.generate("Hello", max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    b = client.generate("Hello", max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    assert a.generated_text == b.generated_text and a.details.seed == 7
    first = client.generate("Hello", max_new_tokens=6).details.tokens[1].text
    stopped = client.generate("Hello", max_new_tokens=6, stop_sequences=[first])
    assert stopped.details.finish_reason.value == "stop_sequence"


def test_async_client(server) -> None:
    async def run():
        client = text_generation.AsyncClient(server.url, timeout=60)
        whole = await client.generate("Hello there", max_new_tokens=5)
        pieces = [e async for e in client.generate_stream("Hello there", max_new_tokens=5)]
        return whole, pieces

    whole, pieces = asyncio.run(run())
    assert pieces[-1].generated_text == whole.generated_text


def test_validation_errors_arrive_as_the_client_exception(server) -> None:
    client = text_generation.Client(server.url, timeout=60)
    with pytest.raises(text_generation.errors.ValidationError, match="max_total_tokens"):
        client.generate("Hello", max_new_tokens=100000)
    with pytest.raises(text_generation.errors.ValidationError):
        client.generate("Hello", max_new_tokens=4, do_sample=True, temperature=-1.0)
