"""``--draft-model``'s checks and plan (:mod:`service.model.draft_model`): a draft that is missing, no safetensors
checkpoint, outside the allowed roots, of another vocabulary or too big to hold resident is refused by name; one
that fits is planned whole on one device, and that plan is what the target's plan reserves."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from planner.errors import PlanError
from planner.placement.inputs import PlanInputs
from service.model.draft_model import DraftModelError, check_same_vocabulary, draft_budget, draft_dir, plan_draft
from service.model.model_paths import PathEscapeError
from service.settings import ServiceSettings

OPTION = "--allowed-root"


def _settings(target: Path, draft: Path | str, **kw: Any) -> ServiceSettings:
    return ServiceSettings(model=str(target), draft_model=str(draft), **kw)


class _Tokenizer:
    """What the check reads of a tokenizer: its vocabulary and special ids."""

    def __init__(self, vocab: dict[str, int], eos: int = 2, special: tuple[int, ...] = (0, 1, 2)):
        self.vocab, self.bos_token_id, self.eos_token_id = vocab, 1, eos
        self.pad_token_id, self.unk_token_id, self.all_special_ids = 0, None, list(special)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_missing_and_non_safetensors_drafts_are_refused(tiny_llama: Path, tiny_draft_llama: Path, tmp_path: Path):
    with pytest.raises(DraftModelError, match="is not a directory"):
        draft_dir(_settings(tiny_llama, tmp_path / "nowhere"), OPTION)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_draft_llama / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(DraftModelError, match="not a safetensors checkpoint"):
        draft_dir(_settings(tiny_llama, pickled), OPTION)
    assert draft_dir(_settings(tiny_llama, tiny_draft_llama), OPTION) == tiny_draft_llama.resolve()


def test_a_draft_linking_outside_the_allowed_roots_is_refused(tiny_llama: Path, tiny_draft_llama: Path, tmp_path):
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in tiny_draft_llama.iterdir():
        (linked / f.name).symlink_to(f)
    with pytest.raises(PathEscapeError, match="outside the allowed roots"):
        draft_dir(_settings(tiny_llama, linked), OPTION)
    allowed = _settings(tiny_llama, linked, allowed_root=[str(tmp_path), str(tiny_draft_llama)])
    assert draft_dir(allowed, OPTION) == linked.resolve()


def test_another_vocabulary_or_other_special_ids_are_refused(tiny_llama: Path, tiny_draft_llama: Path):
    same = _Tokenizer({"a": 0, "b": 1, "c": 2})
    check_same_vocabulary(tiny_llama, same, tiny_draft_llama, _Tokenizer({"a": 0, "b": 1, "c": 2}))
    with pytest.raises(DraftModelError, match=r"another vocabulary .*'c': 2 vs 3"):
        check_same_vocabulary(tiny_llama, same, tiny_draft_llama, _Tokenizer({"a": 0, "b": 1, "c": 3}))
    with pytest.raises(DraftModelError, match="eos_token_id 1, .* has 2"):
        check_same_vocabulary(tiny_llama, same, tiny_draft_llama, _Tokenizer({"a": 0, "b": 1, "c": 2}, eos=1))


def test_the_real_tokenizers_of_target_and_draft_agree(tiny_llama: Path, tiny_draft_llama: Path):
    from loaders import load_tokenizer

    target = load_tokenizer(tiny_llama)
    check_same_vocabulary(tiny_llama, target, tiny_draft_llama, load_tokenizer(tiny_draft_llama))
    other = load_tokenizer(tiny_draft_llama)
    other.add_tokens(["<only-in-the-draft>"])
    with pytest.raises(DraftModelError, match="another vocabulary"):
        check_same_vocabulary(tiny_llama, target, tiny_draft_llama, other)


def test_the_draft_is_planned_whole_on_one_device_and_budgeted_from_that_plan(tiny_draft_llama: Path):
    plan = plan_draft(tiny_draft_llama, PlanInputs(max_memory={"cpu": "4GiB"}, context=512, dtype="float32"))
    assert set(plan.placement.values()) == {"cpu"} and plan.workload.batch_size == 1
    budget = draft_budget(tiny_draft_llama, plan)
    cpu = plan.budget("cpu")
    assert cpu is not None
    assert budget.label == f"draft model {tiny_draft_llama.name}" and budget.device == "cpu"
    assert budget.weights == cpu.weights and budget.working == cpu.activations
    assert budget.kv_per_token * 512 == cpu.kv_cache


def test_a_draft_that_would_stream_from_disk_is_refused(tiny_llama: Path):
    """A box where the draft's plan fits only with layers on disk (the tiny Llama as a draft, in 2.2 MiB): refused,
    not served slower than without it; a box too small for any plan is refused by the planner's own message."""
    tight = PlanInputs(max_memory={"cpu": "2300KiB", "disk": "1GiB"}, context=512, dtype="float32")
    with pytest.raises(DraftModelError, match=r"does not fit resident on one device .*cpu, disk"):
        plan_draft(tiny_llama, tight)
    with pytest.raises(PlanError, match="does not fit"):
        plan_draft(tiny_llama, replace(tight, max_memory={"cpu": "1MiB", "disk": "1GiB"}))


def test_the_served_target_makes_room_for_its_draft_in_a_tight_box(tiny_llama: Path, tiny_draft_llama: Path):
    """The server's own load (:func:`load_model`): in a 3 MiB box the tiny Llama is resident alone; beside its draft
    the target's plan reserves the draft's bytes first and streams part of itself from disk instead, its CPU budget
    still within the box, and the draft is loaded whole on the CPU as its own plan says."""
    from service.model.background_load import load_model

    def load(**kw: Any):
        box = dict(max_memory=["cpu=3MiB", "disk=1GiB"], max_total_tokens=512, max_input_tokens=256)
        return load_model(ServiceSettings(model=str(tiny_llama), **box, **kw), lambda _update: None)

    alone, beside = load(), load(draft_model=str(tiny_draft_llama))
    assert alone.plan is not None and beside.plan is not None
    assert alone.plan.offloaded_bytes == 0 and alone.draft is None
    cpu = beside.plan.budget("cpu")
    assert cpu is not None and cpu.draft > 0 and cpu.total <= cpu.capacity == 3 * 2**20
    assert beside.plan.offloaded_bytes > 0  # what the draft took, the target streams
    assert beside.draft is not None and beside.draft.reserved == cpu.draft and beside.draft.nbytes < cpu.draft
    assert set(beside.draft.model.hf_device_map.values()) == {"cpu"}
    assert beside.draft.cost is not None and "target weights on cpu -" in beside.draft.cost
    assert beside.draft.cost.endswith(f"on disk +{beside.plan.offloaded_bytes / 2**10:.1f}KiB")
