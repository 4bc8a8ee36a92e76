"""min_p and logit_bias at a small vocabulary: they change the distribution as vLLM and OpenAI specify."""

from __future__ import annotations

import math

import torch

from service.engine.sampling import SamplingParams, TokenChooser, choose_batch


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 400) -> set[int]:
    out = set()
    for seed in range(n):
        chooser = TokenChooser.create(SamplingParams(**{**params.__dict__, "seed": seed}))
        out.add(choose_batch(logits.unsqueeze(0), [chooser])[0].token)
    return out


def test_min_p_drops_tokens_less_likely_than_min_p_times_the_top_one() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert _draws(SamplingParams(do_sample=True, temperature=1.0), logits) == {0, 1, 2, 3}
    # 0.25 x 0.5 = 0.125: tokens 0, 1 and 2 stay; 3 (0.05) goes
    assert _draws(SamplingParams(do_sample=True, temperature=1.0, min_p=0.25), logits) == {0, 1, 2}
    assert _draws(SamplingParams(do_sample=True, temperature=1.0, min_p=0.7), logits) == {0}


def test_logit_bias_moves_greedy_and_minus_100_removes_the_greedy_token() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    greedy = TokenChooser.create(SamplingParams(temperature=0))
    assert greedy.choose(logits).token == 0
    banned = TokenChooser.create(SamplingParams(temperature=0, logit_bias=((0, -100.0),)))
    assert banned.choose(logits).token == 1
    forced = TokenChooser.create(SamplingParams(temperature=0, logit_bias=((3, 100.0),)))
    choice = forced.choose(logits)
    assert choice.token == 3 and math.isclose(choice.logprob, 0.0, abs_tol=1e-6)
    # the bias adds to the logit: a bias of +1 on token 1 ties it with token 0 in the distribution
    tied = TokenChooser.create(SamplingParams(temperature=0, logit_bias=((1, 1.0),), seed=0), top_n=2)
    top = tied.choose(logits).top
    assert math.isclose(top[0].logprob, top[1].logprob, abs_tol=1e-6)
