"""Mixture-of-experts planning (issue 15): the skeleton's MoE layers, sparsity-aware decode reads checked against
the experts a real forward touches, and the sub-layer candidate ``auto`` weighs on published configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.api import plan
from planner.model.moe import expected_experts_touched, moe_layers
from planner.model.skeleton import load_skeleton
from planner.placement.sizing import size_blocks
from planner.types import Workload
from tests.loaders.helpers import prompt, reference_model

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"


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


def test_nf4_on_a_moe_config_warns_about_the_experts_and_sizes_them_truthfully():
    """bitsandbytes leaves transformers 5's fused 3-D expert parameters in the compute dtype: the plan sizes them in
    bf16 and its warning names them and their bytes."""
    from planner.placement.sizing import tensor_bytes

    cfg = str(CONFIGS / "mixtral-8x7b.json")
    skel = load_skeleton(cfg)
    nf4 = plan(cfg, quantization="nf4", max_memory={"cpu": "256GiB"})
    experts = [t for m in moe_layers(skel) for t in m.expert_tensors]
    bf16_bytes = sum(t.numel * 2 for t in experts)
    assert sum(tensor_bytes(t, nf4.workload) for t in experts) == bf16_bytes
    warning = next(w for w in nf4.warnings if "does not quantize fused 3-D expert parameters" in w)
    assert f"{bf16_bytes:,} B" in warning and "model.layers.0.mlp.experts" in warning
    # the rest (attention, router, head excluded) is 4-bit: total weights are the bf16 experts plus much less
    assert bf16_bytes < sum(b.weights for b in nf4.budgets) < bf16_bytes * 1.05
    assert not any("does not quantize" in w for w in plan(cfg, max_memory={"cpu": "256GiB"}).warnings)


NEW_CONFIGS = {
    "qwen3-moe-30b-a3b": ("Qwen3MoeConfig", dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)),
    "gpt-oss-20b": ("GptOssConfig", dict(num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24)),
    "gpt-oss-120b": ("GptOssConfig", dict(num_local_experts=128, num_experts_per_tok=4, num_hidden_layers=36)),
    "deepseek-v3": ("DeepseekV3Config", dict(n_routed_experts=256, num_experts_per_tok=8, kv_lora_rank=512)),
}


@pytest.mark.parametrize("name", sorted(NEW_CONFIGS))
def test_published_moe_configs_are_valid_and_plan(name):
    """The example configs are read by transformers' own config classes (with the published values), and plan on
    one 24 GiB GPU with the experts that do not fit computing on the CPU."""
    import json

    import transformers

    from planner.model.skeleton import config_from_dict

    doc = json.loads((CONFIGS / f"{name}.json").read_text())
    cls_name, expected = NEW_CONFIGS[name]
    cfg = config_from_dict(doc)
    assert isinstance(cfg, getattr(transformers, cls_name))
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    skel = load_skeleton(str(CONFIGS / f"{name}.json"))
    assert moe_layers(skel) and skel.experts_per_token == expected["num_experts_per_tok"]
    p = plan(skel, gpus="1x24GiB", max_memory={"cpu": "2TiB"})
    assert "experts_on_cpu" in p.strategy and p.prediction.decode_tokens_per_s > 0


def test_deepseek_v3_on_eight_80gb_gpus_leaves_no_gpu_empty():
    """Issue 15 acceptance: --gpus 8x80GB --max-memory cpu=2TiB at batch 4 x 8192. One MoE layer (~21 GiB) plus the
    double buffer streaming needs do not fit a GPU's spare room, so layer-wise offload left every GPU empty; now the
    GPUs hold whole layers and every layer's attention, and no GPU is empty."""
    p = plan(str(CONFIGS / "deepseek-v3.json"), gpus="8x80GB", max_memory={"cpu": "2TiB"}, batch_size=4, context=8192)
    used = set(p.placement.values())
    assert set(range(8)) <= used
    assert not any("holds nothing" in w for w in p.warnings)
    assert all(b.total <= b.capacity for b in p.budgets)
    for i in range(61):
        assert isinstance(p.placement[f"model.layers.{i}"], int)  # attention and the dense/shared parts on GPUs


def test_a_moe_model_bigger_than_a_host_without_gpus_keeps_its_head_in_ram_and_reads_touched_experts():
    """gpt-oss-20b in bf16 on a host without GPUs, 8 GiB of RAM and a disk: its MoE layers on disk read only the
    experts a token touches (loaders.run.expert_reads), the head all of itself, so auto keeps the head in RAM and
    sends layers to disk instead; 16 sequences touch most experts, so they get far less than 16x one stream."""
    skel = load_skeleton(str(CONFIGS / "gpt-oss-20b.json"))
    p = plan(skel, max_memory={"cpu": "8GiB", "disk": "64GiB"}, dtype="bfloat16")
    assert p.strategy.endswith("head_in_ram"), p.reasons
    assert p.placement["lm_head"] == "cpu" and p.placement["model.layers.23"] == "disk"
    lone = p.prediction.decode_tokens_per_s
    rates = {c.sequences: c.tokens_per_s for c in p.prediction.concurrent}
    assert lone > 0 and rates[16] < 8 * lone
