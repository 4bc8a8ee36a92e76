"""Latency of a running ``loadmaster serve``: time to first token with and without the prefix cache, and the
inter-token latency of running streams while a ~4k-token prompt arrives (chunked prefill should keep it bounded).

Used by :mod:`bench.serve` on its server after the throughput levels (``--skip-latency`` to leave it out).

- **Prefix cache**: one client sends requests one after another, each a ~300-token system prompt and a short
  question. *Cold*: every system prompt starts with a different word, so no request shares a prefix with an earlier
  one. *Warm*: all share the same system prompt (the first request, not counted, puts it in the cache). The time to
  first token is the first server-sent event of ``/generate_stream``.
- **Long prompt**: ``streams`` streams decode; once each has a few tokens, a prompt of ``long_tokens`` tokens is
  sent. Gaps between a stream's tokens are split into those before the long prompt was sent and those ending while
  it was being prefilled (until its first token).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx

SYSTEM = (
    "You are a careful assistant for a harbor village. You answer questions about boats, weather, tides, the "
    "market, the lighthouse and the people who live by the river. Keep every answer short, kind and exact. "
)


def _first_token_s(client: httpx.Client, text: str) -> float:
    """Seconds from sending ``text`` to the first token's event."""
    start = time.perf_counter()
    body = {"inputs": text, "parameters": {"max_new_tokens": 1}}
    with client.stream("POST", "/generate_stream", json=body) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                took = time.perf_counter() - start
                for _ in lines:  # drain the rest of the stream
                    pass
                return took
    raise RuntimeError("the stream ended without a token")


def prefix_cache_ttft(url: str, requests: int = 8, system_repeats: int = 6) -> dict[str, Any]:
    """Median time to first token without a shared prefix (cold) and with one held by the prefix cache (warm)."""
    system = SYSTEM * system_repeats
    questions = [f"Question {i}: when does the {w} open?" for i, w in enumerate(["market", "bridge", "station"] * 8)]
    with httpx.Client(base_url=url, timeout=600) as c:
        cold = [_first_token_s(c, f"Visitor{i} asks. " + system + questions[i]) for i in range(requests)]
        _first_token_s(c, system + "Prime the cache.")
        warm = [_first_token_s(c, system + questions[i]) for i in range(requests)]
    return {
        "ttft_cold_p50_s": round(statistics.median(cold), 4),
        "ttft_warm_p50_s": round(statistics.median(warm), 4),
        "ttft_speedup": round(statistics.median(cold) / statistics.median(warm), 2),
    }


def long_prompt_itl(url: str, long_text: str, streams: int = 4, new_tokens: int = 200) -> dict[str, Any]:
    """Inter-token latency of ``streams`` running streams before and while ``long_text`` is prefilled."""
    stamps: list[list[float]] = [[] for _ in range(streams)]
    ready = threading.Barrier(streams + 1)
    errors: list[str] = []

    def stream(i: int) -> None:
        body = {"inputs": f"Stream {i} tells a story about the river", "parameters": {"max_new_tokens": new_tokens}}
        told = False
        try:
            with httpx.Client(base_url=url, timeout=600) as c, c.stream("POST", "/generate_stream", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        stamps[i].append(time.perf_counter())
                        if len(stamps[i]) == 8 and not told:
                            told = True
                            ready.wait(600)
        except Exception as exc:  # noqa: BLE001 - reported in the result
            errors.append(repr(exc))
        if not told:
            ready.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    ready.wait(600)
    with httpx.Client(base_url=url, timeout=600) as c:
        sent = time.perf_counter()
        first = sent + _first_token_s(c, long_text)
    for t in threads:
        t.join()
    before: list[float] = []
    during: list[float] = []
    for times in stamps:
        for a, b in zip(times, times[1:]):
            if b <= sent:
                before.append(b - a)
            elif b <= first:
                during.append(b - a)
    return {
        "streams": streams,
        "long_prompt_ttft_s": round(first - sent, 3),
        "itl_before_p50_s": round(statistics.median(before), 4) if before else None,
        "itl_during_p50_s": round(statistics.median(during), 4) if during else None,
        "itl_during_max_s": round(max(during), 4) if during else None,
        "errors": errors,
    }


def long_text(tokenizer_dir: str, tokens: int) -> str:
    """Plain words that the model's tokenizer turns into about ``tokens`` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocabulary = SYSTEM.replace(",", "").replace(".", "").split()
    words = [vocabulary[(i * 7) % len(vocabulary)] for i in range(tokens)]
    text = " ".join(words)
    while len(tok(text)["input_ids"]) > tokens:  # decoding and re-encoding need not give the same count
        text = text[: int(len(text) * 0.95)]
    return text
