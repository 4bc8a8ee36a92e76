"""The micro-batch schedule within one host (:mod:`loaders.run.multi_gpu_schedule`), on stand-in devices: a real
transformers model whose decoder layers are split into runs that each have their own worker (all computing on the
CPU here). Greedy tokens equal the model's own ``generate``; with every run made artificially slow (the test-only
``delay_s``), a step of m micro-batches over k runs takes about (m + k - 1) run-times, not m x k."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from loaders.run.multi_gpu_schedule import (
    LayerCapture,
    MicroBatchSchedule,
    find_decoder_layers,
    layer_devices,
    pipelined_forward,
    split_runs,
)

PROMPTS = ["The old lighthouse keeper", "Hello there", "Once upon a time in a quiet village"]


@pytest.fixture
def split_model(request, tiny_llama: Path) -> Iterator[tuple]:
    """tiny Llama with its layers split into runs by the stand-in labels ``request.param``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    capture = LayerCapture(model, "model.layers")
    yield model, capture, split_runs(capture.layers, request.param), AutoTokenizer.from_pretrained(tiny_llama)
    capture.remove()


def _greedy(model, capture, schedule, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding, one micro-batch per prompt (each with its own KV cache), every step pipelined."""
    caches = [DynamicCache(config=model.config) for _ in prompts]
    feed = [torch.tensor([p]) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        calls = [dict(input_ids=f, cache=c, use_cache=True, logits_to_keep=1) for f, c in zip(feed, caches)]
        for i, out in enumerate(pipelined_forward(capture, schedule, calls)):
            token = int(out.logits[0, -1].argmax())
            new[i].append(token)
            feed[i] = torch.tensor([[token]])
    return new


@pytest.mark.parametrize("split_model", [["gpu-a", "gpu-a", "gpu-b", "gpu-c"]], indirect=True)
def test_pipelined_greedy_tokens_equal_generate(split_model) -> None:
    model, capture, runs, tok = split_model
    assert [(r.first, r.last) for r in runs] == [(0, 1), (2, 2), (3, 3)]
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    schedule = MicroBatchSchedule(runs)
    try:
        got = _greedy(model, capture, schedule, ids, 6)
    finally:
        schedule.close()
    capture.remove()  # the model as it was: its own generate is the reference
    for prompt, tokens in zip(ids, got):
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert tokens == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("split_model", [["gpu-a", "gpu-a", "gpu-b", "gpu-b"]], indirect=True)
def test_a_step_of_m_micro_batches_over_k_runs_overlaps(split_model) -> None:
    model, capture, runs, tok = split_model
    m, k, d = 4, len(runs), 0.25
    assert k == 2
    items = [capture.inputs(**tok(PROMPTS[j % len(PROMPTS)], return_tensors="pt"), use_cache=False) for j in range(m)]
    schedule = MicroBatchSchedule(runs, delay_s=d)
    try:
        t0 = time.perf_counter()
        outs = schedule.step(items)
        took = time.perf_counter() - t0
    finally:
        schedule.close()
    assert len(outs) == m and all(o.shape == i[0].shape for o, i in zip(outs, items))
    assert (m + k - 1) * d <= took < (m * k - 1) * d, f"{took:.2f}s for m={m}, k={k}, d={d}"


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="2 layers but 1 device labels"):
        split_runs([torch.nn.Identity(), torch.nn.Identity()], ["cpu"])
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        MicroBatchSchedule(split_runs([torch.nn.Identity()], ["cpu"]), delay_s=-1)


def test_decoder_layers_and_their_devices_are_read_from_the_model_and_its_map(
    tiny_llama: Path, tiny_gpt2: Path
) -> None:
    assert find_decoder_layers(AutoModelForCausalLM.from_pretrained(tiny_llama)) == "model.layers"
    assert find_decoder_layers(AutoModelForCausalLM.from_pretrained(tiny_gpt2)) == "transformer.h"
    two_gpus = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    assert layer_devices(two_gpus, "model.layers", 2) == [0, 1]
    assert layer_devices({"": "cpu"}, "model.layers", 2) == ["cpu", "cpu"]
    assert layer_devices({"model": 0, "model.layers.1.mlp": 1}, "model.layers", 2) is None  # layer 1 is split
    assert layer_devices({"model.layers.0": 0}, "model.layers", 2) is None  # layer 1 is not placed
