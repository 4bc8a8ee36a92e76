"""The batched sampler against transformers' own logits processors, and row independence within a batch."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from service.engine.sampling import SamplingParams, TokenChooser, choose_batch

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def _kept(params: SamplingParams, row: torch.Tensor) -> set[int]:
    """The tokens the sampler can draw for ``row``: found by drawing many times with many seeds."""
    seen = set()
    for seed in range(400):
        chooser = TokenChooser.create(SamplingParams(**{**params.__dict__, "seed": seed}))
        seen.add(chooser.choose(row).token)
    return seen


def _reference_kept(params: SamplingParams, row: torch.Tensor) -> set[int]:
    scores = row.unsqueeze(0).clone()
    ids = torch.zeros((1, 1), dtype=torch.long)
    processors = []
    if params.temperature:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p is not None:
        processors.append(TopPLogitsWarper(params.top_p))
    if params.typical_p is not None:
        processors.append(TypicalLogitsWarper(params.typical_p))
    for proc in processors:
        scores = proc(ids, scores)
    return set(torch.nonzero(torch.isfinite(scores[0])).flatten().tolist())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, top_k=5),
        SamplingParams(do_sample=True, top_p=0.5),
        SamplingParams(do_sample=True, temperature=0.7, top_k=8, top_p=0.8),
        SamplingParams(do_sample=True, typical_p=0.4),
    ],
)
def test_truncation_keeps_what_transformers_keeps(params: SamplingParams) -> None:
    row = _logits(1, seed=3)[0]
    want = _reference_kept(params, row)
    got = _kept(params, row)
    assert got <= want  # never draws a token transformers would exclude
    assert got == want if len(want) <= 8 else int(row.argmax()) in got  # draws from all of it (400 seeds)


def test_repetition_and_openai_penalties_match_their_definitions() -> None:
    row = _logits(1, seed=5)[0]
    prompt = [1, 2, 3]
    generated = [3, 4, 4]
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    chooser = TokenChooser.create(params, prompt_ids=prompt, top_n=VOCAB)
    for t in generated:
        chooser.accept(t)
    choice = chooser.choose(row)
    # reference: transformers' repetition penalty over prompt + output, then OpenAI's counts over the output
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + generated]), row.unsqueeze(0).clone())[0]
    counts = torch.zeros(VOCAB)
    for t in generated:
        counts[t] += 1
    ref = ref - 0.5 * counts - 0.25 * (counts > 0).float()
    ref_lp = torch.log_softmax(ref, dim=-1)
    got = {a.id: a.logprob for a in choice.top}
    for token in range(VOCAB):
        assert got[token] == pytest.approx(ref_lp[token].item(), abs=1e-5)
    assert choice.token == int(ref.argmax())


def test_a_batch_chooses_what_each_row_would_alone() -> None:
    logits = _logits(6, seed=11)
    settings = [
        SamplingParams(),
        SamplingParams(do_sample=True, seed=1),
        SamplingParams(do_sample=True, temperature=0.6, top_k=10, seed=2),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(do_sample=True, top_p=0.7, typical_p=0.9, seed=3, frequency_penalty=1.0),
        SamplingParams(temperature=0),
    ]

    def choosers() -> list[TokenChooser]:
        out = [TokenChooser.create(p, prompt_ids=[5, 6], top_n=3) for p in settings]
        for c in out:
            c.accept(7)
        return out

    batch = choosers()
    alone = choosers()
    for step in range(5):
        together = choose_batch(logits, batch)
        single = [alone[r].choose(logits[r]) for r in range(len(settings))]
        assert [c.token for c in together] == [c.token for c in single]
        for a, b in zip(together, single):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
            assert [t.id for t in a.top] == [t.id for t in b.top]
        for c, x in zip(batch, together):
            c.accept(x.token)
        for c, x in zip(alone, single):
            c.accept(x.token)
        logits = logits.roll(step + 1, dims=1)


def test_greedy_rows_take_the_argmax_and_report_sorted_alternatives() -> None:
    logits = _logits(3, seed=2)
    choices = choose_batch(logits, [TokenChooser.create(SamplingParams(), top_n=4) for _ in range(3)])
    for row, choice in zip(logits, choices):
        assert choice.token == int(row.argmax())
        assert choice.logprob == pytest.approx(torch.log_softmax(row, -1).max().item(), abs=1e-6)
        assert [a.id for a in choice.top][0] == choice.token
        lps = [a.logprob for a in choice.top]
        assert lps == sorted(lps, reverse=True) and len(lps) == 4


def test_alternatives_the_mask_rules_out_are_not_reported() -> None:
    # Found by schemathesis: top_logprobs=2 under response_format json_object, where the grammar allowed one token,
    # reported an alternative at -inf, which JSON cannot carry (a 500 on /v1/chat/completions).
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 3], logits[0, 5] = 1.0, 0.5
    (choice,) = choose_batch(logits, [TokenChooser.create(SamplingParams(), top_n=4)])
    assert [a.id for a in choice.top] == [3, 5]
    assert all(math.isfinite(a.logprob) for a in choice.top)


def test_sampling_follows_the_distribution() -> None:
    row = torch.tensor([math.log(0.7), math.log(0.2), math.log(0.1)] + [-1e9] * (VOCAB - 3))
    counts = [0, 0, 0]
    chooser = TokenChooser.create(SamplingParams(do_sample=True, seed=123))
    for _ in range(2000):
        counts[chooser.choose(row).token] += 1
    assert counts[0] / 2000 == pytest.approx(0.7, abs=0.05)
    assert counts[1] / 2000 == pytest.approx(0.2, abs=0.05)
    assert counts[2] / 2000 == pytest.approx(0.1, abs=0.05)
