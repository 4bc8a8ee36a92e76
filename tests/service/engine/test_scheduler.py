"""The scheduler on its own, without a model: what one forward runs is a typed record the test can read.

Decode rows come first, in slot order, then prompt chunks within the iteration's prompt-token budget, oldest
sequence first; admission stops at the KV budget; a forward's rows are recorded in their slots."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from service.engine.kv_pool import SlotKVCache
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
    args |= kw
    # no model and no prefix reuse: the pool's storage is never made, only its shape is asked
    return Scheduler(SlotKVCache(args["slots"], args["max_total_tokens"]), **args)


def test_decode_rows_come_first_then_prompt_chunks_within_the_budget(tok) -> None:
    s = _scheduler(prefill_chunk=8)
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


def test_short_sequences_run_beyond_the_plans_slots_and_a_long_one_waits_for_an_idle_pool(tok) -> None:
    """A KV budget of two full-context sequences (2 x 256 tokens) seats 8 short ones at once: the storage,
    8 slots x 64 positions, stays within it. A full-context request then waits until the pool is idle, and the
    storage starts again at its shape (1 slot x 256), forgetting the short ones' prefixes."""
    s = _scheduler(slots=16, max_total_tokens=256, kv_budget_tokens=2 * 256, max_queue=16)
    short = [_seq(tok, [1, 2, 3 + i], new=20) for i in range(8)]
    long = _seq(tok, list(range(1, 200)), new=50)
    for seq in [*short, long]:
        s.add(seq)
    assert s.admit() == short and [q.slot for q in short] == list(range(8))
    assert s.cache.storage_tokens(8, 23) == 8 * 64 <= s.kv_budget_tokens
    s.cache._grow(8, 23)  # what the first forward's binding does
    s.contents.tokens[0] = [1, 2, 3]
    assert s.admit() == [], "16 slots x 256 would not fit: it waits"
    for q in short[:7]:
        q.done = True
    s.release()
    assert s.admit() == [], "first come first served: one short sequence still runs"
    short[7].done = True
    s.release()
    assert s.admit() == [long] and long.slot == 0 and long.prefilled == 0
    assert (s.cache.allocated, s.cache.capacity) == (0, 0) and s.contents.tokens[0] == []
    assert s.cache.storage_tokens(1, 249) == 256


# -- the prefill budget: a wave together, a long prompt beside streams in steps that keep their latency ------------
def test_a_wave_gets_the_whole_ceiling_and_few_prompts_beside_streams_what_fits_the_itl_target() -> None:
    from service.engine.prefill_budget import MIN_PREFILL, PrefillBudget

    b = PrefillBudget(itl_target_s=0.4)
    assert b.tokens(2048, decoders=0, prompts=16) == 2048  # nobody decodes: all of it
    assert b.tokens(2048, decoders=3, prompts=1) == 2048  # nothing measured yet
    b.observe(0, 8, 0.1)  # decode rows alone: 0.1 s a step
    b.observe(500, 8, 0.6)  # 500 prompt tokens beside them added 0.5 s: 1 ms a token
    assert b.tokens(2048, decoders=8, prompts=1) == 300  # (0.4 - 0.1) s / 1 ms
    assert b.tokens(2048, decoders=8, prompts=8) == 2048  # as many prompts as streams: a wave, prefilled together
    assert b.tokens(256, decoders=0, prompts=1) == 256 and b.last == 256  # never above the ceiling
    b.observe(0, 8, 1.0)  # a contended CPU: decode steps alone near the target
    assert b.tokens(2048, decoders=8, prompts=1) == MIN_PREFILL  # a prompt still progresses


@pytest.mark.parametrize("first_alone", [False, True])
def test_a_wave_of_16_prompts_is_prefilled_within_two_steps(tiny_llama: Path, first_alone: bool) -> None:
    """16 distinct 128-token prompts arrive together (or 15 while a stream decodes): every one is wholly prefilled
    within two forwards of the wave's arrival, not one chunk per prompt in turn (8 forwards at the former 256)."""
    import queue

    import torch
    from transformers import AutoModelForCausalLM

    from planner.types import PREFILL_CHUNK
    from service.engine.engine import Engine
    from service.engine.requests import FinishEvent, TokenEvent

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    words = "river stone light garden winter market letter window harbor forest engine silver".split()
    prompts = [
        tok(f"{i} " + " ".join(words[(i * 5 + j) % 12] for j in range(300)))["input_ids"][:128] for i in range(16)
    ]
    assert sum(map(len, prompts)) <= PREFILL_CHUNK and all(len(p) == 128 for p in prompts)
    engine = Engine(model, tok, max_batch_size=16, max_queue=32, max_total_tokens=256, prefix_cache=False)
    forwards = [0]
    prefilled_at: dict[int, int] = {}  # prompt -> the forward (counted on the engine thread) that completed it
    record = engine.scheduler.record_forward

    def counting(rows) -> None:
        record(rows)
        forwards[0] += 1
        for r in rows:
            if r.prefill and not r.seq.prefilling:
                prefilled_at[prompts.index(list(r.seq.request.prompt_ids))] = forwards[0]

    engine.executor._record_forward = counting
    sinks = [queue.Queue() for _ in prompts]
    engine.start()
    try:
        rest = range(16)
        if first_alone:  # a stream decodes beside the wave
            engine.submit(GenerationRequest(prompt_ids=prompts[0], max_new_tokens=120), sinks[0].put)
            assert isinstance(sinks[0].get(timeout=60), TokenEvent)
            rest = range(1, 16)
        arrived = forwards[0]
        for i in rest:
            engine.submit(GenerationRequest(prompt_ids=prompts[i], max_new_tokens=4), sinks[i].put)
        for i in rest:
            while not isinstance(sinks[i].get(timeout=120), FinishEvent):
                pass
    finally:
        engine.stop()
    steps = [prefilled_at[i] - arrived for i in rest]
    # while the wave arrived, at most one forward ran with its first arrivals; the next took all that were left
    assert max(steps) <= 2, steps
