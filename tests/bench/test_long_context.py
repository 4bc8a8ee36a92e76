"""bench/long_context's workers on the tiny Llama: they run what they say (the engine's native step), and in fp32
our engine's greedy tokens at a context of several prefill chunks equal transformers' batched ``generate``."""

from __future__ import annotations

import json

import pytest

from bench import long_context
from loaders.native import kernel_build


def test_engine_and_generate_agree_across_chunks(tiny_llama, monkeypatch):
    monkeypatch.setattr(long_context, "CHUNK", 16)  # a 40-token prompt in three chunks
    assert json.loads((tiny_llama / "config.json").read_text())["dtype"] == "float32"
    spec = {"model": str(tiny_llama), "dtype": "float32", "rows": 3, "context": 40, "new_tokens": 6, "threads": 2}
    ours = long_context.loadmaster_worker(spec)
    theirs = long_context.transformers_worker(spec)
    assert ours["tokens"] == theirs["tokens"]
    assert all(len(t) == 6 for t in ours["tokens"])
    assert len({tuple(t) for t in ours["tokens"]}) > 1  # rows differ: each row's cache is its own
    assert ours["decode_tok_s"] > 0 and theirs["decode_tok_s"] > 0
    assert ours["native_step"] == kernel_build.status().available


def test_decode_rate_is_rows_over_the_median_step():
    assert long_context.decode_rate(4, [0.0, 0.1, 0.2, 1.2, 1.3]) == pytest.approx(40.0)
