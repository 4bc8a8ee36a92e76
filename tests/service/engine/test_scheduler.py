"""The scheduler on its own, without a model: what one forward runs is a typed record the test can read.

Decode rows come first, in slot order, then prompt chunks within the iteration's prompt-token budget, oldest
sequence first; admission stops at the KV budget; a forward's rows are recorded in their slots."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from service.engine.requests import GenerationRequest, Sequence
from service.engine.scheduler import Scheduler, SchedulerOutput
from service.errors import GenerationError, OverloadedError


def _seq(tok, prompt: list[int], new: int = 4) -> Sequence:
    return Sequence(GenerationRequest(prompt_ids=prompt, max_new_tokens=new), lambda e: None, tok, eos=set())


@pytest.fixture
def tok(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _scheduler(**kw) -> Scheduler:
    args = dict(slots=2, max_queue=4, max_total_tokens=64, kv_budget_tokens=128, prefix_cache=False)
    return Scheduler(None, **(args | kw))  # no prefix reuse: the KV pool itself is never touched


def test_decode_rows_come_first_then_prompt_chunks_within_the_budget(tok, monkeypatch) -> None:
    monkeypatch.setattr("service.engine.scheduler.PREFILL_CHUNK", 8)
    s = _scheduler()
    short, long = _seq(tok, [1, 2, 3]), _seq(tok, list(range(1, 13)))
    for seq in (short, long):
        s.add(seq)
    assert s.admit() == [short, long] and (short.slot, long.slot) == (0, 1)

    first = s.schedule()
    assert isinstance(first, SchedulerOutput) and first.decodes == 0
    assert [(r.seq, r.row.start, len(r.row.tokens), r.prefill) for r in first.rows] == [
        (short, 0, 3, True),
        (long, 0, 5, True),
    ]
    assert first.prefill_budget == 0 and not first.deferred
    s.record_forward(first.rows)
    assert (short.prefilled, long.prefilled, s.prefilled_tokens) == (3, 5, 8)
    assert s.contents.tokens[1] == list(range(1, 6))

    short.record(7)  # the executor chose its first token
    second = s.schedule()
    assert second.decodes == 1
    assert [(r.seq, r.row.start, r.row.tokens, r.prefill) for r in second.rows] == [
        (short, 3, [7], False),
        (long, 5, list(range(6, 13)), True),
    ]


def test_admission_stops_at_the_kv_budget_and_the_queue_at_its_bound(tok) -> None:
    s = _scheduler(kv_budget_tokens=10, max_queue=2)
    a, b = _seq(tok, [1, 2, 3], new=4), _seq(tok, [1, 2], new=4)  # 7 + 6 tokens: one at a time
    for seq in (a, b):
        s.add(seq)
    with pytest.raises(OverloadedError):
        s.add(_seq(tok, [1]))
    with pytest.raises(GenerationError, match="tokens of KV cache"):
        s.check_fits(_seq(tok, [1, 2, 3, 4, 5, 6, 7, 8], new=4))
    assert s.admit() == [a] and s.reserved_tokens == 7
    a.done = True
    s.release()
    assert s.admit() == [b] and s.running == [b]
