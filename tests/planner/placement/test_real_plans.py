"""Plans for real architectures at their real sizes (meta device): byte-exact weights, valid placements."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from planner.api import plan
from planner.model.skeleton import config_from_dict, skeleton_from_model
from planner.types import Plan
from tests.planner.real_configs import REAL_CONFIGS

HARDWARE = [
    ("4x24GiB+cpu", {0: "24GiB", 1: "24GiB", 2: "24GiB", 3: "24GiB", "cpu": "512GiB"}),
    ("2x80GB", {0: "80GB", 1: "80GB", "cpu": "256GiB"}),
    ("cpu+disk", {"cpu": "32GiB", "disk": "1TiB"}),
]


@pytest.fixture(scope="module", params=sorted(REAL_CONFIGS))
def real(request):
    name = request.param
    for dtype in (torch.bfloat16,):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config_from_dict(REAL_CONFIGS[name]), dtype=dtype)
    return name, model, skeleton_from_model(model, name=name)


def _exact_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers of the meta model in bf16, each shared tensor once (what from_pretrained allocates)."""
    seen, total = set(), 0
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("hw_name,max_memory", HARDWARE)
def test_plan_weights_are_exact_and_plan_valid(real, hw_name, max_memory):
    name, model, skel = real
    p = plan(skel, max_memory=max_memory, dtype="bf16", batch_size=8, context=4096)
    assert sum(b.weights for b in p.budgets) == _exact_bytes(model)
    for b in p.budgets:
        assert b.total <= b.capacity, (name, hw_name, b.device)
    # every tensor is covered by exactly one most-specific device map key, on its block's device (or, for a MoE
    # layer's routed experts split off their layer, on the device of that part: its most specific placement name)
    keys = sorted(p.device_map, key=len, reverse=True)
    owner = skel.block_of_tensor()
    parts = sorted(p.placement, key=len, reverse=True)
    for tname in owner:
        match = next(k for k in keys if k == "" or tname == k or tname.startswith(k + "."))
        part = next(n for n in parts if tname == n or tname.startswith(n + "."))
        assert p.device_map[match] == p.placement[part]
    for group in skel.tied_groups:
        devs = {p.placement[owner[t]] for t in group if t in owner}
        head = [b.name for b in skel.blocks if b.is_head]
        devs |= {p.placement[h] for h in head if any(t.startswith(h + ".") for t in group)}
        assert len(devs) == 1
    # the KV cache of every layer is budgeted once
    kv_total = sum(b.kv_cache for b in p.budgets)
    assert kv_total == skel.kv.num_layers * 2 * skel.kv.num_kv_heads * skel.kv.head_dim * 2 * 8 * 4096
    assert Plan.from_json(p.to_json()) == p
    assert p.prediction.decode_tokens_per_s > 0


def test_70b_on_four_24gib_gpus_uses_every_gpu_and_offloads_the_rest():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_from_dict(REAL_CONFIGS["llama-3-70b"]), dtype=torch.bfloat16)
    skel = skeleton_from_model(model, name="llama-3-70b")
    p = plan(skel, gpus="4x24GiB", max_memory={"cpu": "256GiB"}, dtype="bf16", context=4096)
    used = set(p.placement.values())
    assert {0, 1, 2, 3} <= used and "cpu" in used
    assert p.offloaded_bytes > 0 and any("offloaded" in w for w in p.warnings)
    nf4 = plan(skel, gpus="4x24GiB", max_memory={"cpu": "256GiB"}, quantization="nf4", context=4096)
    assert nf4.offloaded_bytes == 0  # ~37 GiB in nf4 fits 4 x 24 GiB
    assert nf4.prediction.decode_tokens_per_s > p.prediction.decode_tokens_per_s
