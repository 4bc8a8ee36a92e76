"""``--speculate int4|int8`` (issue 35): the target's own weights, quantized at load and resident, draft for the
target. Greedy output is the same token for token with and without the drafts (resident, half on disk, one request
or several at once); a trained model's copy really is accepted; a draft's cache is cut back to what the target
kept, so drafting incrementally proposes what drafting from scratch would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.engine.engine import Engine
from service.engine.speculation.model_drafter import DraftAsk, ModelDrafter
from service.engine.speculation.step_gate import StepGate
from service.engine.speculation.verification import Speculator
from service.model.draft_copy import draft_dtype, load_draft_copy
from tests.models import demo_model_dir
from tests.service.engine.test_speculation import _requests, _tokens


def _generate(model, tok, requests, mode: str, slots: int, draft=None) -> tuple[list[list[int]], Engine]:
    engine = Engine(
        model, tok, max_batch_size=slots, max_queue=64, speculate=mode, speculate_tokens=4, draft_model=draft
    )
    engine.speculator.gate.measure = False  # draft whatever the timing: the test is that drafts change nothing
    engine.start()
    try:
        return _tokens(engine, requests), engine
    finally:
        engine.stop()


def _same_with_and_without(model, tok, scheme: str, path: Path, concurrent: int, new_tokens: int = 20) -> Engine:
    copy = load_draft_copy(path, scheme, "float32")
    reqs = _requests(tok, concurrent, new_tokens)
    plain, _ = _generate(model, tok, reqs, "off", slots=concurrent)
    spec, engine = _generate(model, tok, reqs, scheme, slots=concurrent, draft=copy.model)
    assert spec == plain
    stats = engine.speculator.stats
    assert stats.proposed > 0 and stats.verify_passes > 0
    assert stats.verify_passes < stats.emitted <= stats.accepted + stats.verify_passes
    return engine


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("concurrent", [1, 6])
def test_greedy_is_identical_with_quantized_drafts_on_the_tiny_llama(
    tiny_llama: Path, scheme: str, concurrent: int
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    _same_with_and_without(model, tok, scheme, tiny_llama, concurrent)


@pytest.mark.parametrize("concurrent", [1, 6])
def test_greedy_is_identical_with_quantized_drafts_half_on_disk(tiny_llama: Path, tmp_path, concurrent: int) -> None:
    from loaders.load import load_model

    device_map = {"": "cpu", "model.layers.2": "disk", "model.layers.3": "disk"}
    model = load_model(tiny_llama, device_map, offload_folder=tmp_path / "offload", show_progress=False)
    assert "disk" in set(model.hf_device_map.values())
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    _same_with_and_without(model, tok, "int4", tiny_llama, concurrent)


class _ProbingGate(StepGate):
    """A gate that probes every step: one greedy row of the batch drafts, as a shut gate's probe lets it."""

    def _decide(self, rows: int) -> int:
        return 1


def test_a_probe_drafts_one_row_of_the_batch_and_keeps_greedy_tokens(tiny_llama: Path) -> None:
    """A shut gate's probe must cost one row's catch-up, not every row's prompt: one row a step drafts, and the
    batch's tokens are still plain greedy decoding's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    reqs = _requests(tok, 6, 20)
    plain, _ = _generate(model, tok, reqs, "off", slots=6)
    copy = load_draft_copy(tiny_llama, "int4", "float32")
    engine = Engine(
        model, tok, max_batch_size=6, max_queue=64, speculate="int4", speculate_tokens=4, draft_model=copy.model
    )
    engine.speculator.gate = _ProbingGate()
    engine.start()
    try:
        assert _tokens(engine, reqs) == plain
    finally:
        engine.stop()
    passes = engine.speculator.stats.verify_passes
    assert 0 < passes <= engine.steps  # at most one verify row a step (six would draft with the gate open)


def test_a_trained_models_int8_copy_is_mostly_accepted_on_text_that_does_not_repeat() -> None:
    """The quick demo model (trained a few steps) on prose prompt lookup finds little in: its int8 copy is the
    target up to rounding, so most of its drafts are accepted and a verify pass yields well over one token."""
    path = demo_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    engine = _same_with_and_without(model, tok, "int8", path, 1, new_tokens=40)
    stats = engine.speculator.stats
    assert stats.acceptance_rate is not None and stats.acceptance_rate > 0.6, stats
    assert stats.tokens_per_pass is not None and stats.tokens_per_pass > 2.0, stats


def test_the_copy_holds_a_fraction_of_the_targets_bytes(tiny_llama: Path) -> None:
    target = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    full = sum(p.numel() * p.element_size() for p in target.parameters())
    int8, int4 = (load_draft_copy(tiny_llama, s, "float32") for s in ("int8", "int4"))
    # the tiny model's embeddings (not quantized) are a large share of it; the linear layers shrink 4x / 8x
    assert int4.nbytes < int8.nbytes < full * 0.6
    assert int8.to_dict() == {"scheme": "int8", "dtype": "float32", "bytes": int8.nbytes}
    assert draft_dtype("float16") == "bfloat16" and draft_dtype("bfloat16") == "bfloat16"


def test_a_row_cut_back_after_rejections_drafts_what_a_fresh_row_drafts(tiny_llama: Path) -> None:
    """Drafts the target rejected are cut off the row's slot (the next tokens overwrite them, the mask hides the
    rest); the next draft equals one from a fresh slot that prefills the same tokens."""
    copy = load_draft_copy(tiny_llama, "int8", "float32")
    drafter = ModelDrafter(copy.model, slots=2, max_len=128)
    row = drafter.row(0)
    tokens = list(range(5, 25))
    first = drafter.propose([DraftAsk(row, tokens, 4)])
    drafts = first.drafts[0]
    assert len(drafts) == 4 and row.held == tokens + drafts[:3]
    assert first.prefill_seconds > 0  # the 20-token context was prefilled apart (timed apart for the gate)
    # the target kept the first draft, then chose another token: the other three drafts are rejected
    tokens += [drafts[0], (drafts[1] + 1) % 100]
    again = drafter.propose([DraftAsk(row, tokens, 3)])
    assert row.held == tokens + again.drafts[0][:2] and again.prefill_seconds == 0  # three new tokens: no prefill
    assert again.drafts[0] == drafter.row(1).propose(tokens, 3)
    held = list(row.held)
    assert row.propose(tokens + [again.drafts[0][0]], 0) == [] and row.held == held  # k=0 runs nothing
    # after a rest (k=0 for a while) the row catches up on everything it missed in one prefill
    later = tokens + list(range(40, 70))
    assert row.propose(later, 2) == drafter.row(1).propose(later, 2)
    with pytest.raises(ValueError, match="outside the draft cache"):
        drafter.row(2)


def test_rows_drafted_together_draft_what_each_drafts_alone(tiny_llama: Path) -> None:
    """A step's rows share the copy's forwards (contexts of different lengths packed, then one-token rows batched),
    each wanting its own count of drafts; each gets what it gets alone."""
    copy = load_draft_copy(tiny_llama, "int8", "float32")
    together = ModelDrafter(copy.model, slots=3, max_len=128)
    alone = ModelDrafter(copy.model, slots=3, max_len=128)
    contexts = [list(range(3, 40)), list(range(50, 56)), list(range(7, 30))]
    wants = [4, 2, 0]
    batch = together.propose([DraftAsk(together.row(s), t, k) for s, (t, k) in enumerate(zip(contexts, wants))])
    assert [len(d) for d in batch.drafts] == wants
    assert batch.drafts == [alone.row(s).propose(t, k) for s, (t, k) in enumerate(zip(contexts, wants))]


def test_the_speculator_refuses_a_draft_model_it_would_ignore_and_needs_one_it_drafts_with(tiny_llama: Path) -> None:
    copy = load_draft_copy(tiny_llama, "int4", "float32")
    with pytest.raises(ValueError, match="drafts with a quantized copy"):
        Speculator("int4")
    with pytest.raises(ValueError, match="drafts without a model"):
        Speculator("ngram", model=ModelDrafter(copy.model, 1, 16))
    with pytest.raises(ValueError, match="no draft copy"):
        load_draft_copy(tiny_llama, "int2", "float32")


def test_a_server_drafting_with_its_int8_copy_reports_it_in_info(tiny_llama: Path) -> None:
    import httpx

    from service.schemas.response_models import InfoResponse
    from tests.service.conftest import LiveServer, settings_for

    server = LiveServer(settings_for(tiny_llama, speculate="int8", speculate_tokens=3)).start()
    try:
        body = {"inputs": "one two three one two three", "parameters": {"max_new_tokens": 24}}
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        info = httpx.get(server.url + "/info", timeout=30).json()
    finally:
        server.stop()
    InfoResponse.model_validate(info)  # the documented shape, draft_model included
    spec = info["speculation"]
    assert spec["mode"] == "int8" and spec["draft_tokens"] == 3
    assert spec["draft_model"]["scheme"] == "int8" and spec["draft_model"]["dtype"] == "float32"
    checkpoint = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))  # fp32
    assert 0 < spec["draft_model"]["bytes"] < checkpoint
    # the target's plan reserved the copy (weights, working memory, KV) and says what that cost
    cpu = next(b for b in info["plan"]["budgets"] if b["device"] == "cpu")
    assert spec["draft_model"]["reserved_bytes"] == cpu["draft"] > spec["draft_model"]["bytes"]
    cost = spec["draft_model"]["cost"]
    assert cost.startswith("draft: int8 copy") and cost in info["plan"]["reasons"]
    assert spec["proposed"] > 0 and spec["verify_passes"] > 0


def test_seeded_sampled_rows_draft_with_the_copy_and_reproduce_whatever_their_batch(tiny_llama: Path) -> None:
    """A greedy copy's draft is a point mass, as prompt lookup's: sampled rows take the same accept/resample rule,
    and a seed gives the same tokens alone or among neighbours (each row's drafts come from its own slot)."""
    from service.engine.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    copy = load_draft_copy(tiny_llama, "int8", "float32")
    seeded = _requests(tok, 3, 30, params=SamplingParams(temperature=0.3, top_k=3, seed=11))
    alone, engine = _generate(model, tok, seeded, "int8", slots=3, draft=copy.model)
    assert engine.speculator.stats.accepted > 0
    neighbours = _requests(tok, 5, 12)
    together, _ = _generate(model, tok, neighbours + seeded, "int8", slots=8, draft=copy.model)
    assert together[len(neighbours) :] == alone
