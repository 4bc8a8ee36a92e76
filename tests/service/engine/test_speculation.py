"""Speculative decoding (issue 35): prompt lookup drafts verified inside continuous batching give the same greedy
tokens as decoding without them, resident and with layers on disk, one request or sixteen at once; and the drafts
really are accepted (the counters move)."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.engine.engine import Engine
from service.engine.requests import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from service.engine.sampling import Choice, SamplingParams
from service.engine.speculation.ngram_drafter import NgramIndex, propose
from service.engine.speculation.step_gate import PROBE_EVERY, StepGate
from service.engine.speculation.verification import DraftLength, accepted, sampled
from tests.models import llama_100m_dir

#: Prompts that repeat themselves, so that prompt lookup has something to find.
PROMPTS = [
    "one two three four one two three four one two three",
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "a b c d e f a b c d e f a b c",
    "Hello world, hello world, hello world, hello",
    "red green blue red green blue red green",
    "Once upon a time there was a time upon a time",
]


def _tokens(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    sinks = [queue.Queue() for _ in requests]
    for req, sink in zip(requests, sinks):
        engine.submit(req, sink.put)
    out = []
    for sink in sinks:
        ids = []
        while True:
            ev = sink.get(timeout=120)
            if isinstance(ev, ErrorEvent):
                raise AssertionError(ev.message)
            if isinstance(ev, TokenEvent):
                ids.append(ev.id)
            if isinstance(ev, FinishEvent):
                assert ev.generated_tokens == len(ids)
                break
        out.append(ids)
    return out


def _generate(model, tok, requests, speculate: str, slots: int) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, tok, max_batch_size=slots, max_queue=64, speculate=speculate, speculate_tokens=4)
    engine.speculator.gate.measure = False  # draft whatever the timing: the test is that drafts change nothing
    engine.start()
    try:
        return _tokens(engine, requests), engine
    finally:
        engine.stop()


def _requests(tok, concurrent: int, new_tokens: int, **kw) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_ids=tok(PROMPTS[i % len(PROMPTS)])["input_ids"], max_new_tokens=new_tokens + i, **kw)
        for i in range(concurrent)
    ]


def _same_with_and_without(model, tok, concurrent: int, new_tokens: int = 24) -> Engine:
    reqs = _requests(tok, concurrent, new_tokens)
    plain, _ = _generate(model, tok, reqs, "off", slots=concurrent)
    spec, engine = _generate(model, tok, reqs, "ngram", slots=concurrent)
    assert spec == plain
    return engine


@pytest.mark.parametrize("concurrent", [1, 16])
def test_greedy_is_identical_with_ngram_drafts_on_the_tiny_llama(tiny_llama: Path, concurrent: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = _same_with_and_without(model, tok, concurrent)
    stats = engine.speculator.stats
    assert stats.proposed > 0 and stats.verify_passes > 0
    assert stats.accepted > 0, stats  # the drafts really ran: a random model's greedy loops repeat its text
    assert stats.verify_passes < stats.emitted <= stats.accepted + stats.verify_passes


@pytest.mark.parametrize("concurrent", [1, 16])
def test_greedy_is_identical_with_ngram_drafts_half_on_disk(tiny_llama: Path, tmp_path, concurrent: int) -> None:
    from loaders.load import load_model

    device_map = {"": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    model = load_model(tiny_llama, device_map, offload_folder=tmp_path / "offload", show_progress=False)
    assert "disk" in set(model.hf_device_map.values())
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = _same_with_and_without(model, tok, concurrent)
    assert engine.speculator.stats.accepted > 0


@pytest.mark.parametrize("concurrent", [1, 16])
def test_greedy_is_identical_with_ngram_drafts_on_the_100m_llama(concurrent: int) -> None:
    path = llama_100m_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    engine = _same_with_and_without(model, tok, concurrent, new_tokens=12)
    assert engine.speculator.stats.proposed > 0


def test_greedy_is_identical_with_ngram_drafts_on_the_100m_llama_half_on_disk(tmp_path) -> None:
    from loaders.load import load_model

    path = llama_100m_dir()
    layers = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).config.num_hidden_layers
    device_map = {"": "cpu", **{f"model.layers.{i}": "disk" for i in range(layers // 2, layers)}}
    model = load_model(path, device_map, offload_folder=tmp_path / "offload", show_progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    for concurrent in (1, 16):
        engine = _same_with_and_without(model, tok, concurrent, new_tokens=8)
        assert engine.speculator.stats.proposed > 0


def test_stop_conditions_apply_to_each_accepted_token(tiny_llama: Path) -> None:
    """An end-of-sequence token among the accepted drafts ends the sequence there; max_new_tokens holds exactly."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    reqs = _requests(tok, 6, 5)
    plain, _ = _generate(model, tok, reqs, "off", slots=6)
    # make a token the plain run produces mid-way an end of sequence: both runs must stop right at it
    stop = {ids[3] for ids in plain if len(ids) > 3}
    reqs = _requests(tok, 6, 20, stop_token_ids=frozenset(stop))
    plain, _ = _generate(model, tok, reqs, "off", slots=6)
    spec, _ = _generate(model, tok, reqs, "ngram", slots=6)
    assert spec == plain
    for req, ids in zip(reqs, plain):
        assert len(ids) <= req.max_new_tokens


def test_logprob_rows_do_not_speculate(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    alts = _requests(tok, 2, 16, top_n_tokens=3)
    penalised = _requests(tok, 2, 16, params=SamplingParams(repetition_penalty=1.3))
    plain, _ = _generate(model, tok, alts + penalised, "off", slots=4)
    spec, engine = _generate(model, tok, alts + penalised, "ngram", slots=4)
    assert spec == plain
    assert engine.speculator.stats.proposed == 0


def test_seeded_sampled_rows_speculate_and_reproduce_whatever_their_batch(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    params = SamplingParams(temperature=0.3, top_k=3, seed=11)  # peaked: a random model's loops come through
    seeded = _requests(tok, 3, 30, params=params)
    alone, engine = _generate(model, tok, seeded, "ngram", slots=3)
    assert engine.speculator.stats.accepted > 0
    neighbours = _requests(tok, 5, 12)
    together, _ = _generate(model, tok, neighbours + seeded, "ngram", slots=8)
    assert together[len(neighbours) :] == alone


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square statistic (cells with no expectation left out)."""
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_the_accept_resample_rule_keeps_the_target_distribution() -> None:
    """Six tokens, drafts [2, 4]: the first emitted token follows p0, and the second, after an accepted 2, p1."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.tensor([[0.5, 1.0, 1.5, 0.0, -1.0, 0.2], [1.0, 0.0, 0.3, 0.3, 1.2, -0.5], [0.0] * 6])
    probs = torch.softmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1)
    draws = 20000
    first = torch.zeros(6)
    second = torch.zeros(6)
    for _ in range(draws):
        verdict = sampled([2, 4], probs, logprobs, gen)
        tokens = [c.token for c in verdict.choices]
        first[tokens[0]] += 1
        if tokens[0] == 2:
            second[tokens[1]] += 1
        assert abs(verdict.choices[0].logprob - float(logprobs[0, tokens[0]])) < 1e-6
    assert _chi_square_p(first, probs[0] * draws) > 0.01
    assert _chi_square_p(second, probs[1] * second.sum()) > 0.01


def test_sampling_through_the_engine_has_the_same_distribution_with_and_without_drafts(tiny_llama: Path) -> None:
    """A small vocabulary (top_k=4): the third generated token over many seeds, with and without ngram drafts, is
    one distribution (a chi-square test of homogeneity, p > 0.01), and drafts were accepted."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok(PROMPTS[2])["input_ids"]
    n = 400
    counts = {}
    for mode, offset in (("off", 0), ("ngram", 10_000)):
        reqs = [
            GenerationRequest(prompt_ids=prompt, max_new_tokens=4, params=SamplingParams(top_k=4, seed=offset + i))
            for i in range(n)
        ]
        engine = Engine(model, tok, max_batch_size=16, max_queue=n, speculate=mode, speculate_tokens=3)
        engine.start()
        try:
            counts[mode] = [ids[2] for ids in _tokens(engine, reqs)]
        finally:
            engine.stop()
        if mode == "ngram":
            assert engine.speculator.stats.accepted > 0
    vocab = sorted(set(counts["off"]) | set(counts["ngram"]))
    table = torch.tensor([[counts[m].count(t) for t in vocab] for m in ("off", "ngram")], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = len(vocab) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    assert p > 0.01, (table, p)


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # the latest occurrence of 1 2 3
    assert propose([4, 5, 6, 4, 8], 3) == []  # no earlier "4 8", "8": nothing
    assert propose([4, 5, 6, 4], 3) == [5, 6, 4]
    assert propose([1, 2, 3], 0) == []


def _scan(tokens: list[int], k: int) -> list[int]:
    """Prompt lookup by brute force: the latest earlier occurrence of the longest suffix (3..1 tokens)."""
    for n in range(min(3, len(tokens) - 1), 0, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_incremental_index_proposes_what_a_full_scan_finds() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = torch.randint(0, 5, (60,), generator=gen).tolist()
        index = NgramIndex()
        for end in range(1, len(tokens) + 1):  # the sequence grows a token at a time, as a decoding row's does
            assert index.propose(tokens[:end], 3) == _scan(tokens[:end], 3)


def test_the_longest_prefix_of_matching_drafts_is_accepted_plus_the_target_token() -> None:
    choices = [Choice(t, 0.0) for t in (5, 6, 9, 1)]
    verdict = accepted([5, 6, 7], choices)
    assert verdict.accepted == 2 and [c.token for c in verdict.choices] == [5, 6, 9]
    verdict = accepted([5, 6, 9], choices)
    assert verdict.accepted == 3 and [c.token for c in verdict.choices] == [5, 6, 9, 1]


def test_the_gate_shuts_greedy_drafting_where_it_costs_more_per_token_and_probes_with_one_row() -> None:
    gate = StepGate()
    assert gate.allowed(16) == 1  # nothing measured yet: one row probes, so a first look costs one catch-up
    gate.observe(16, 0.300, 20, drafted=True)  # 15 ms a token
    assert gate.allowed(16) == 0  # a plain step to compare with
    gate.observe(16, 0.160, 16, drafted=False)  # 10 ms a token: the probe cost more
    assert not any(gate.allowed(16) for _ in range(PROBE_EVERY - 1))
    assert gate.allowed(16) == 1  # the next probe is one row again
    assert gate.allowed(15) == 0  # a count never compared borrows the nearest one's verdict: no new probe


def test_a_probe_that_pays_earns_every_row_a_trial_and_drafting_that_pays_stays_open() -> None:
    gate = StepGate()
    gate.observe(16, 0.160, 16, drafted=False)  # 10 ms a token
    assert gate.allowed(16) == 1
    gate.observe(16, 0.100, 20, drafted=True)  # the probe: 5 ms a token
    assert gate.allowed(16) == 16  # every row drafts, to measure that
    gate.observe(16, 0.120, 32, drafted=True)  # 3.75 ms a token: it pays
    assert gate.allowed(16) == 16 and gate.allowed(13) == 13  # a batch a little narrower borrows the verdict
    # while drafting pays, one step in PROBE_EVERY is plain, to keep the plain cost current
    opened = [gate.allowed(16) for _ in range(PROBE_EVERY)]
    assert opened.count(0) == 1 and set(opened) == {0, 16}


def test_a_trial_that_costs_more_shuts_the_gate_until_the_next_probe() -> None:
    gate = StepGate()
    gate.observe(16, 0.160, 16, drafted=False)
    gate.allowed(16)
    gate.observe(16, 0.100, 20, drafted=True)  # the one-row probe pays ...
    assert gate.allowed(16) == 16
    gate.observe(16, 0.480, 32, drafted=True)  # ... but every row drafting costs 15 ms a token
    steps = 1
    while gate.allowed(16) != 1:
        steps += 1
    assert steps == PROBE_EVERY


def test_a_batch_far_wider_than_any_compared_measures_for_itself() -> None:
    """Drafting that pays at 2 rows says nothing of 16: the gate compares a plain 16-row step and a probe first."""
    gate = StepGate()
    gate.observe(2, 0.020, 2, drafted=False)
    gate.observe(2, 0.020, 6, drafted=True)  # at 2 rows drafting pays
    assert gate.allowed(2) == 2
    assert gate.allowed(16) == 0  # no verdict within a quarter of 16 rows: a plain step to compare with
    gate.observe(16, 0.050, 16, drafted=False)
    assert gate.allowed(16) == 1  # then a one-row probe, not every row's catch-up at once


def test_the_gate_measures_a_plain_step_when_every_step_drafted() -> None:
    """Rows whose drafts are always accepted never rest: the gate itself lets a plain step through to compare."""
    gate = StepGate()
    gate.observe(1, 0.030, 2, drafted=True)
    assert gate.allowed(1) == 0  # drafted steps measured, plain ones never: one plain step
    gate.observe(1, 0.010, 1, drafted=False)  # 10 ms a token against 15: drafting costs more
    assert not any(gate.allowed(1) for _ in range(PROBE_EVERY - 1))


def test_the_gate_probes_less_often_while_drafts_keep_costing_more() -> None:
    gate = StepGate()
    gate.observe(1, 0.010, 1, drafted=False)
    gate.observe(1, 0.030, 2, drafted=True)
    gaps = []
    for _ in range(6):
        steps = 1
        while not gate.allowed(1):
            steps += 1
        gaps.append(steps)
    assert gaps == [64, 128, 256, 512, 1024, 1024]  # each probe (a drafting step) found drafts dearer
    for _ in range(10):
        gate.observe(1, 0.010, 4, drafted=True)  # drafting pays now: the interval starts over
    assert gate.allowed(1) == 1 and gate.probe_every == PROBE_EVERY


def test_the_draft_length_adapts_and_rests_after_failures() -> None:
    length = DraftLength(4)
    assert length.current() == 4
    length.observe(4, 0)
    assert length.current() == 2
    length.observe(2, 0)
    assert length.current() == 1
    length.observe(1, 0)
    resting = [length.current() for _ in range(8)]
    assert resting == [0] * 8  # no drafts while it rests ...
    assert length.current() == 1  # ... then one probe
    length.observe(1, 1)
    assert length.current() == 2
