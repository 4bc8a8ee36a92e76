"""Batched prefill: prompts prefilled together compute what each would alone, and are grouped sensibly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.batch import DecodeBatch, prefill, prefill_groups

PROMPTS = ["Once upon a time there was a river", "Hello", "The sea was calm and the night was long", "Rain fell"]
CPU = torch.device("cpu")


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2"])
def test_prompts_prefilled_together_match_each_alone(request, fixture: str) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # rows really are padded

    logits, cache, mask = prefill(model, CPU, prompts)
    together = DecodeBatch(model, CPU)
    together.add(list(range(len(prompts))), cache, mask)
    assert mask.sum(dim=1).tolist() == [len(p) for p in prompts]

    for row, prompt in enumerate(prompts):
        alone_logits, _, alone_mask = prefill(model, CPU, [prompt])
        assert alone_mask.all()  # a lone prompt has no padding
        torch.testing.assert_close(logits[row], alone_logits[0], atol=1e-4, rtol=1e-4)

    # all rows decoded together give every prompt its lone greedy continuation
    tokens = logits.argmax(dim=-1).tolist()
    got = [[t] for t in tokens]
    for _ in range(6):
        tokens = together.step(tokens).argmax(dim=-1).tolist()
        for row, t in enumerate(tokens):
            got[row].append(t)
    for row, prompt in enumerate(prompts):
        assert got[row] == _alone(model, prompt, steps=6)


def _alone(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    logits, cache, mask = prefill(model, CPU, [prompt])
    batch = DecodeBatch(model, CPU)
    batch.add([0], cache, mask)
    token = int(logits[0].argmax())
    out = [token]
    for _ in range(steps):
        token = int(batch.step([token])[0].argmax())
        out.append(token)
    return out


def test_groups_cover_every_prompt_once_shortest_first() -> None:
    lengths = [21, 37, 55, 71, 89, 25, 45, 61, 78, 95, 32, 46, 65, 82, 100, 38]
    groups = prefill_groups(lengths, max_tokens=256, max_padding=0.25)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths)
    assert 1 < len(groups) < len(lengths)  # batched, but not all in one padded forward
    for g in groups:
        width = max(lengths[i] for i in g)
        padded = width * len(g)
        assert len(g) == 1 or padded <= 256
        assert len(g) == 1 or padded - sum(lengths[i] for i in g) <= 0.25 * padded


def test_a_prompt_over_the_budget_is_prefilled_alone() -> None:
    assert prefill_groups([300, 10, 12], max_tokens=256) == [[1, 2], [0]]
    assert prefill_groups([10, 100], max_tokens=256, max_padding=0.25) == [[0], [1]]  # too much padding
    assert prefill_groups([], max_tokens=256) == []
