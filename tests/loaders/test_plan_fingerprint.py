"""A Plan names the checkpoint it was made for; the loader refuses to apply it to another one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import loaders
import planner
from planner.errors import PlanError
from planner.model.skeleton import skeleton_from_dir
from tests.loaders.helpers import assert_equivalent, copy_checkpoint

CPU = {"cpu": "1GiB"}


def test_a_plan_carries_its_checkpoints_fingerprint_through_json(tiny_llama):
    p = planner.plan(str(tiny_llama), max_memory=CPU, dtype="float32")
    assert p.fingerprint and p.fingerprint.startswith("sha256:")
    assert p.fingerprint == skeleton_from_dir(tiny_llama).fingerprint
    assert planner.Plan.from_json(p.to_json()).fingerprint == p.fingerprint
    bare = planner.plan(str(tiny_llama / "config.json"), max_memory=CPU, dtype="float32")
    assert bare.fingerprint is None
    assert planner.Plan.from_json(bare.to_json()).fingerprint is None


def test_a_copied_checkpoint_keeps_its_plans(tiny_llama, tmp_path):
    p = planner.plan(str(tiny_llama), max_memory=CPU, dtype="float32")
    copy = copy_checkpoint(tiny_llama, tmp_path / "copy")
    model = loaders.load_model(copy, device_map=planner.Plan.from_json(p.to_json()), show_progress=False)
    assert_equivalent(model, tiny_llama)


def test_the_loader_refuses_a_plan_made_for_another_checkpoint(tiny_llama, tmp_path):
    """Same architecture, same tensor names, re-saved in bfloat16: the map would validate, the fingerprint does not."""
    p = planner.plan(str(tiny_llama), max_memory=CPU, dtype="float32")
    other = copy_checkpoint(tiny_llama, tmp_path / "resaved")
    for shard in sorted(other.glob("*.safetensors")):
        tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    assert skeleton_from_dir(other).fingerprint != p.fingerprint
    with pytest.raises(PlanError, match=r"made for another checkpoint than .*resaved.*Plan again for this directory"):
        loaders.load_model(other, device_map=p, show_progress=False)


def test_a_plan_from_a_bare_config_is_accepted(tiny_llama):
    bare = planner.plan(str(tiny_llama / "config.json"), max_memory=CPU, dtype="float32")
    model = loaders.load_model(tiny_llama, device_map=bare, show_progress=False)
    assert model.hf_device_map == bare.device_map
