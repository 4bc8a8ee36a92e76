"""The model runner over the slot KV cache: rows prefilled together, in any slots, in chunks, with a prefix copied
from another slot, compute what each prompt would alone in plain transformers; prefill chunks are grouped sensibly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.kv_cache import SlotKVCache
from service.model_runner import ModelRunner, Row
from service.prefill_groups import prefill_groups

PROMPTS = ["Once upon a time there was a river", "Hello", "The sea was calm and the night was long", "Rain fell"]
CPU = torch.device("cpu")
STEPS = 6


def _reference(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Plain transformers: the prompt's last logits and its greedy continuation."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = model(ids).logits[0, -1]
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
        )
    return logits, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gpt2", "tiny_moe"])
def test_rows_in_scattered_slots_match_each_prompt_alone(request, fixture: str) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # rows really are padded
    cache = SlotKVCache(slots=6, max_len=64)
    runner = ModelRunner(model, CPU, cache)
    slots = [4, 0, 2, 5]  # not consecutive: the cache gathers the rows
    logits = runner.forward([Row(s, 0, p) for s, p in zip(slots, prompts)])
    got = [[int(t)] for t in logits.argmax(dim=-1)]
    for row, prompt in enumerate(prompts):
        ref_logits, _ = _reference(model, prompt)
        torch.testing.assert_close(logits[row], ref_logits, atol=1e-5, rtol=1e-5)
    positions = [len(p) for p in prompts]
    for _ in range(STEPS - 1):
        step = runner.forward([Row(s, pos, seq[-1:]) for s, pos, seq in zip(slots, positions, got)])
        for seq, t in zip(got, step.argmax(dim=-1).tolist()):
            seq.append(t)
        positions = [p + 1 for p in positions]
    for row, prompt in enumerate(prompts):
        assert got[row] == _reference(model, prompt)[1]


def test_chunked_prefill_and_a_copied_prefix_match_a_whole_prefill(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok(" ".join(PROMPTS * 3))["input_ids"]
    cache = SlotKVCache(slots=3, max_len=256)
    runner = ModelRunner(model, CPU, cache)
    ref_logits, _ = _reference(model, prompt)
    # slot 0: the prompt in chunks of 7, a decode-sized row on the way
    start = 0
    while start < len(prompt):
        chunk = prompt[start : start + 7]
        logits = runner.forward([Row(0, start, chunk)])
        start += len(chunk)
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-5, rtol=1e-5)
    # slot 2: all but the last 3 tokens copied from slot 0, the rest fed
    cache.copy_prefix(0, 2, 0, len(prompt) - 3)
    logits = runner.forward([Row(2, len(prompt) - 3, prompt[-3:])])
    torch.testing.assert_close(logits[0], ref_logits, atol=1e-5, rtol=1e-5)
    assert cache.capacity >= len(prompt) and cache.capacity <= 256


def test_a_row_past_the_slot_length_is_refused(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    runner = ModelRunner(model, CPU, SlotKVCache(slots=1, max_len=8))
    with pytest.raises(ValueError, match="holds 8 per sequence"):
        runner.forward([Row(0, 5, [1, 2, 3, 4])])


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
