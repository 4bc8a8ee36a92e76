"""Mixture-of-experts planning (issue 15): the skeleton's MoE layers, sparsity-aware decode reads checked against
the experts a real forward touches, and the sub-layer candidate ``auto`` weighs on published configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.api import plan
from planner.moe import expected_experts_touched, moe_layers
from planner.sizing import size_blocks
from planner.skeleton import load_skeleton
from planner.types import Workload
from tests.loaders.helpers import prompt, reference_model

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_skeleton_knows_router_shared_and_routed_experts(tiny_qwen_moe):
    skel = load_skeleton(str(tiny_qwen_moe))
    layers = moe_layers(skel)
    assert [m.layer_index for m in layers] == [0, 1, 2, 3]
    m = layers[0]
    assert (m.experts, m.num_experts, m.top_k) == ("model.layers.0.mlp.experts", 8, 2)
    assert {t.name.rpartition(".")[2] for t in m.expert_tensors} == {"gate_up_proj", "down_proj"}
    assert m.router == ("model.layers.0.mlp.gate.weight",)
    assert m.shared and all("shared_expert" in n for n in m.shared)
    # bytes per expert: what the real module holds, divided by E
    model = reference_model(str(tiny_qwen_moe))
    real = sum(p.numel() * p.element_size() for p in model.model.layers[0].mlp.experts.parameters())
    item = size_blocks(skel, Workload(dtype="float32"))[[b.name for b in skel.blocks].index("model.layers.0")]
    assert item.expert_weight == real


def test_dense_models_have_no_moe_layers(tiny_llama):
    assert moe_layers(load_skeleton(str(tiny_llama))) == ()


def test_expected_experts_touched_formula():
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2)
    assert expected_experts_touched(256, 8, 4) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 4))
    assert expected_experts_touched(8, 2, 10_000) == pytest.approx(8)
    assert expected_experts_touched(8, 0, 1) == 8  # unknown routing: dense


def _touched_bytes_per_decode_step(path: Path, batch: int, seeds: range) -> tuple[float, float]:
    """(mean routed-expert bytes one decode step of ``batch`` sequences really touches, bytes per expert), counted
    from the router's choices handed to every experts module by forward hooks."""
    model = reference_model(str(path))
    experts = [layer.mlp.experts for layer in model.model.layers]
    per_expert = sum(p.numel() * p.element_size() for p in experts[0].parameters()) / experts[0].num_experts
    touched: list[int] = []
    record = [False]

    def hook(module, args):
        if record[0]:
            touched.append(int(torch.unique(args[1]).numel()))

    handles = [e.register_forward_pre_hook(hook) for e in experts]
    try:
        steps = 0
        for seed in seeds:
            ids = prompt(model.config.vocab_size, length=6, batch=batch, seed=seed)
            with torch.no_grad():
                out = model(ids, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                record[0] = True
                model(nxt, cache=out.past_key_values, use_cache=True)
                record[0] = False
            steps += 1
    finally:
        for h in handles:
            h.remove()
    return sum(touched) * per_expert / steps, per_expert


def _predicted_expert_read(path: Path, batch: int) -> float:
    skel = load_skeleton(str(path))
    items = size_blocks(skel, Workload(dtype="float32", batch_size=batch))
    return sum(it.read_per_token - (it.weight - it.expert_weight) for it in items if it.expert_weight)


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_predicted_expert_bytes_equal_a_real_forward_at_batch_1(fixture, request):
    """At batch 1 a decode step reads exactly k experts per layer: the prediction must be that count, exactly."""
    path = request.getfixturevalue(fixture)
    real, _ = _touched_bytes_per_decode_step(path, 1, range(3))
    assert _predicted_expert_read(path, 1) == pytest.approx(real, rel=1e-6)


def test_predicted_expert_bytes_match_a_real_forward_at_batch_4(tiny_qwen_moe):
    """At batch 4 (8 experts, top-2) the expected distinct experts are 8*(1-(3/4)^4) = 5.47 per layer; random
    weights route roughly uniformly, so the measured mean over 32 layer-steps is within 15% (the dense figure,
    8 per layer, would be 46% off)."""
    real, per_expert = _touched_bytes_per_decode_step(tiny_qwen_moe, 4, range(8))
    predicted = _predicted_expert_read(tiny_qwen_moe, 4)
    assert predicted == pytest.approx(real, rel=0.15)
    dense = 8 * 4 * per_expert
    assert abs(dense - real) > 0.3 * real


def test_mixtral_on_one_24gib_gpu_keeps_attention_on_gpu_and_experts_on_cpu():
    """Issue 15 acceptance: Mixtral-8x7B on --gpus 1x24GiB --max-memory cpu=256GiB. ``auto`` puts every layer's
    attention on GPU 0, the routed experts that do not fit there on the CPU, predicts at least 4x the layer-wise
    plan, and says why."""
    cfg = str(CONFIGS / "mixtral-8x7b.json")
    kw = dict(gpus="1x24GiB", max_memory={"cpu": "256GiB"})
    layer_wise = plan(cfg, strategy="sequential", **kw)
    auto = plan(cfg, **kw)
    assert "experts_on_cpu" in auto.strategy
    assert auto.prediction.decode_tokens_per_s >= 4 * layer_wise.prediction.decode_tokens_per_s
    placement = auto.placement
    for i in range(32):
        assert placement[f"model.layers.{i}"] == 0  # attention, norms, router
        assert placement.get(f"model.layers.{i}.mlp.experts", 0) in (0, "cpu")
    on_cpu = [i for i in range(32) if placement.get(f"model.layers.{i}.mlp.experts") == "cpu"]
    assert len(on_cpu) >= 16
    for i in on_cpu:
        assert auto.device_map[f"model.layers.{i}.mlp.experts"] == "cpu"
    why = " ".join(auto.reasons)
    assert "compute on the CPU" in why and "2 of 8 experts" in why
    assert auto.offloaded_bytes < 2**30  # nothing but the input embeddings is streamed
