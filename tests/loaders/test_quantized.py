"""bitsandbytes nf4 on the CPU, and ``quantization="int8"`` there (the native int8 kernels, not bitsandbytes): they
load, generate, and allocate exactly what the planner predicts."""

from __future__ import annotations

import warnings

import pytest
import torch

import loaders
import planner
from loaders.native.quantization import QuantizedCPULinear
from planner.errors import PlanError


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_quantized_load_generates_and_matches_planned_size(tiny_llama, quantization):
    import bitsandbytes as bnb

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = loaders.load_model(tiny_llama, device_map={"": "cpu"}, dtype="float32", quantization=quantization)
        q_proj = model.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, QuantizedCPULinear if quantization == "int8" else bnb.nn.Linear4bit)
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 11)
    planned = planner.plan(
        str(tiny_llama), strategy={"": "cpu"}, dtype="float32", quantization=quantization, context=64
    )
    if quantization == "int8":  # quantized after placement: what the model holds, each tensor once
        held = sum({id(t): t.nbytes for t in [*model.parameters(), *model.buffers()]}.values())
        assert held == planned.budget("cpu").weights and planned.workload.cpu_quantization == "int8"
    else:
        assert model.load_stats.bytes_per_device == {"cpu": planned.budget("cpu").weights}
    plain = planner.plan(str(tiny_llama), strategy={"": "cpu"}, dtype="float32", context=64)
    assert planned.budget("cpu").weights < plain.budget("cpu").weights


def test_quantized_disk_offload_is_refused(tiny_llama):
    with pytest.raises(PlanError, match="cannot be offloaded to disk"):
        loaders.load_model(tiny_llama, device_map={"model.layers.3": "disk", "": "cpu"}, quantization="nf4")


def test_unknown_quantization(tiny_llama):
    with pytest.raises(PlanError, match="unknown quantization 'int3'"):
        loaders.load_model(tiny_llama, device_map={"": "cpu"}, quantization="int3")
