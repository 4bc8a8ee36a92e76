"""Sub-layer MoE placement: routed experts on the CPU, the rest of every layer on a GPU (issue 15).

No GPU here: the CPU stands in for GPU 0 (``gpu_device``) and for the execution device, as in the streaming tests,
and a second stand-in (``meta`` as the GPU) proves where each piece receives its inputs. The device maps come from
the planner itself, so the planner's nested ``model.layers.N.mlp.experts`` entries are what the loader obeys.
"""

from __future__ import annotations

import pytest
import torch

import loaders
from loaders.cpu_experts import cpu_expert_entries, install_gpu_execution_with_cpu_experts
from loaders.streaming import CpuBackend
from planner.api import plan
from tests.loaders.helpers import assert_equivalent


def _planned_map(path) -> dict:
    """What ``auto`` plans for a GPU too small for the experts, behind a slow host link (at these tiny sizes the
    per-layer hop to the CPU would otherwise cost more than streaming)."""
    p = plan(
        str(path),
        gpus="1x1MiB",
        max_memory={"cpu": "1GiB"},
        gpu_reserve=0,
        context=32,
        dtype="float32",
        bandwidths={"link": 1e8},
    )
    assert "experts_on_cpu" in p.strategy, p.reasons
    return p.device_map


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_experts_on_cpu_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    dm = _planned_map(path)
    model = loaders.load_model(path, device_map={"": "cpu"}, show_progress=False)
    experts = cpu_expert_entries(model, dm)
    n_layers = model.config.num_hidden_layers
    assert experts and all(k.endswith(".mlp.experts") for k in experts)
    # every layer's attention is on the GPU stand-in
    for i in range(n_layers):
        assert loaders.device_map.entry_of(f"model.layers.{i}.self_attn.q_proj.weight", dm) in dm
        assert dm[loaders.device_map.entry_of(f"model.layers.{i}.self_attn.q_proj.weight", dm)] == 0
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    streamer = install_gpu_execution_with_cpu_experts(
        model, dm, placement, torch.device("cpu"), backend=CpuBackend(), gpu_device=lambda i: torch.device("cpu")
    )
    streamed = {b.key for b in streamer.blocks} if streamer is not None else set()
    assert not streamed & set(experts), "experts on the CPU must compute there, not be streamed"
    assert_equivalent(model, path)


def test_cpu_experts_receive_host_inputs_and_return_to_the_gpu(tiny_moe):
    """GPU 0 and the execution device are ``meta``: the experts must get their inputs on the CPU (where their
    weights are) and hand their output back on the GPU; their layer must get its inputs on the GPU."""
    model = loaders.load_model(tiny_moe, device_map={"": "cpu"}, show_progress=False)
    dm = {"": 0, "model.layers.1": 0, "model.layers.1.mlp.experts": "cpu"}
    placement = {n: "cpu" for n, _ in model.named_parameters(remove_duplicate=False)}
    install_gpu_execution_with_cpu_experts(
        model, dm, placement, torch.device("meta"), backend=CpuBackend(), gpu_device=lambda i: torch.device("meta")
    )
    seen = {}
    experts = model.model.layers[1].mlp.experts
    experts.forward = lambda h, idx, w: seen.setdefault("experts", h.device) and h * 2
    layer = model.model.layers[1]  # the experts' layer, on GPU 0: aligned there
    layer.forward = lambda x, *a, **k: seen.setdefault("layer", x.device) and x
    h = torch.ones(3, 64)
    out = experts(h, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    layer(h)
    assert seen == {"experts": torch.device("cpu"), "layer": torch.device("meta")}
    assert out.device.type == "cpu"  # called from the CPU, returned to the CPU
    # the output goes back to the device the caller computes on (a meta tensor cannot be copied to the host, so the
    # caller's device is recorded as the pre-hook would for a call from GPU 0)
    experts.forward = lambda h, idx, w: h * 2
    experts.register_forward_pre_hook(lambda m, a: setattr(m, "_loadmaster_return_device", torch.device("meta")))
    out = experts(h, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
    assert out.device.type == "meta"
