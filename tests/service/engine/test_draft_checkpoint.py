"""``--draft-model`` (issue 35): a smaller checkpoint with the target's tokenizer drafts through the same
:class:`~service.engine.speculation.model_drafter.ModelDrafter` as the quantized copy. It is planned and loaded by
the one describe -> plan -> place path (:mod:`service.model.draft_model`); greedy output is the same token for token
with and without it, the target resident or half on disk, one request or sixteen at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from planner.placement.inputs import PlanInputs
from service.engine.engine import Engine
from service.model.draft_model import load_draft_model, plan_draft
from tests.service.engine.test_speculation import _requests, _tokens

#: The box the draft is planned on in these tests: roomy, the engine's context.
BOX = PlanInputs(max_memory={"cpu": "4GiB"}, context=512, dtype="float32")


def _draft(path: Path) -> torch.nn.Module:
    return load_draft_model(path, plan_draft(path, BOX)).model


def _generate(model, tok, requests, slots: int, draft=None) -> tuple[list[list[int]], Engine]:
    mode = "model" if draft is not None else "off"
    engine = Engine(
        model, tok, max_batch_size=slots, max_queue=64, max_total_tokens=512, speculate=mode, draft_model=draft
    )
    engine.speculator.gate.measure = False  # draft whatever the timing: the test is that drafts change nothing
    engine.start()
    try:
        return _tokens(engine, requests), engine
    finally:
        engine.stop()


def _same_with_and_without(model, tok, draft, concurrent: int) -> Engine:
    reqs = _requests(tok, concurrent, 20)
    plain, _ = _generate(model, tok, reqs, slots=concurrent)
    spec, engine = _generate(model, tok, reqs, slots=concurrent, draft=draft)
    assert spec == plain
    assert engine.speculator.stats.proposed > 0 and engine.speculator.stats.verify_passes > 0
    return engine


@pytest.mark.parametrize("concurrent", [1, 16])
def test_greedy_is_identical_with_a_draft_checkpoint(tiny_llama: Path, tiny_draft_llama: Path, concurrent: int):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    draft = _draft(tiny_draft_llama)
    assert draft.config.num_hidden_layers < model.config.num_hidden_layers
    assert set(draft.hf_device_map.values()) == {"cpu"}  # placed by its plan: resident
    _same_with_and_without(model, tok, draft, concurrent)


@pytest.mark.parametrize("concurrent", [1, 16])
def test_greedy_is_identical_with_a_draft_checkpoint_half_on_disk(
    tiny_llama: Path, tiny_draft_llama: Path, tmp_path: Path, concurrent: int
):
    from loaders.load import load_model

    device_map = {"": "cpu", "model.layers.2": "disk", "model.layers.3": "disk"}
    model = load_model(tiny_llama, device_map, offload_folder=tmp_path / "offload", show_progress=False)
    assert "disk" in set(model.hf_device_map.values())
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    _same_with_and_without(model, tok, _draft(tiny_draft_llama), concurrent)


def test_a_draft_that_agrees_is_accepted(tiny_llama: Path):
    """The target's own checkpoint as its draft agrees on every greedy token: the drafts are all accepted, so a
    verify pass yields more than one token (the accept path of the draft-model mode, not just its rejections)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    engine = _same_with_and_without(model, tok, _draft(tiny_llama), 2)
    stats = engine.speculator.stats
    assert stats.acceptance_rate is not None and stats.acceptance_rate > 0.9, stats
    assert stats.tokens_per_pass is not None and stats.tokens_per_pass > 2.0, stats
