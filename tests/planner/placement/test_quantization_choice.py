"""``quantization="int8"`` where no GPU computes is the native int8 CPU kernels, in the plan and in the load; the
plan names the kernel of each tier."""

from __future__ import annotations

import pytest
import torch

import loaders
from loaders.native.quantization import QuantizedCPULinear
from planner.api import plan
from planner.types import Plan
from tests.loaders.helpers import prompt, reference_model
from tests.planner.synthetic import llama_like

SKEL = llama_like(layers=4, hidden=128, intermediate=256, vocab=512)


def test_int8_without_a_gpu_plans_the_native_int8_kernels():
    native = plan(SKEL, max_memory={"cpu": "1GiB"}, dtype="bf16", cpu_quantization="int8")
    asked = plan(SKEL, max_memory={"cpu": "1GiB"}, dtype="bf16", quantization="int8")
    assert asked.workload.quantization is None and asked.workload.cpu_quantization == "int8"
    assert asked.budgets[0].weights == native.budgets[0].weights
    assert asked.kernels == {"cpu": "linear_q8 (native int8)"}
    both = plan(SKEL, max_memory={"cpu": "1GiB"}, dtype="bf16", quantization="int8", cpu_quantization="int8")
    assert both.workload.cpu_quantization == "int8" and both.workload.quantization is None


def test_gpus_nf4_and_float16_keep_bitsandbytes():
    on_gpu = plan(SKEL, gpus="1x1GiB", max_memory={"cpu": "1GiB"}, quantization="int8", gpu_reserve=0)
    assert on_gpu.workload.quantization == "int8" and on_gpu.workload.cpu_quantization is None
    assert on_gpu.kernels == {"GPU 0": "bitsandbytes int8"}
    nf4 = plan(SKEL, max_memory={"cpu": "1GiB"}, quantization="nf4")
    assert nf4.workload.quantization == "nf4" and nf4.kernels == {"cpu": "bitsandbytes nf4 (its CPU backend)"}
    half = plan(SKEL, max_memory={"cpu": "1GiB"}, quantization="int8", dtype="fp16")
    assert half.workload.quantization == "int8" and half.workload.dtype == "float16"


def test_a_float16_checkpoint_under_native_quantization_computes_in_bfloat16():
    fp16 = llama_like(layers=2, hidden=64, intermediate=128, vocab=256, dtype="float16")
    assert plan(fp16, max_memory={"cpu": "1GiB"}, quantization="int8").workload.dtype == "bfloat16"
    assert plan(fp16, max_memory={"cpu": "1GiB"}, cpu_quantization="int4").workload.dtype == "bfloat16"
    assert plan(fp16, max_memory={"cpu": "1GiB"}).workload.dtype == "float16"


def test_kernels_per_tier_with_disk_and_with_gpus():
    cpu_disk = plan(SKEL, max_memory={"cpu": "1MiB", "disk": "1GiB"}, dtype="bf16", context=16)
    assert cpu_disk.kernels["cpu"].startswith("linear_bf16")
    assert cpu_disk.kernels["disk"].startswith("linear_bf16") and "shard's map" in cpu_disk.kernels["disk"]
    mixed = plan(SKEL, gpus="1x1MiB", max_memory={"cpu": "1GiB"}, dtype="fp16", gpu_reserve=0, context=16)
    assert mixed.kernels["GPU 0"] == "torch float16"
    assert mixed.kernels["cpu"].startswith("streamed to the GPU: torch float16")
    again = Plan.from_json(cpu_disk.to_json())
    assert again.kernels == cpu_disk.kernels


def test_load_with_int8_on_the_cpu_takes_the_native_kernels(tiny_llama):
    asked = loaders.load_model(tiny_llama, device_map={"": "cpu"}, quantization="int8", show_progress=False)
    native = loaders.load_model(tiny_llama, device_map={"": "cpu"}, cpu_quantization="int8", show_progress=False)
    layers = [m for m in asked.modules() if isinstance(m, QuantizedCPULinear)]
    assert layers and all(m.scheme == "int8" for m in layers)
    assert not any(type(m).__name__ == "Linear8bitLt" for m in asked.modules())
    assert asked.load_stats.cpu_quantization is not None
    ids = prompt(asked.config.vocab_size)
    with torch.no_grad():
        got, same, want = asked(ids).logits, native(ids).logits, reference_model(tiny_llama)(ids).logits
    assert torch.equal(got, same)
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_load_with_int8_and_a_plan_made_for_it(tiny_llama):
    the_plan = plan(tiny_llama, max_memory={"cpu": "1GiB"}, quantization="int8")
    model = loaders.load_model(tiny_llama, device_map=the_plan, quantization="int8", show_progress=False)
    assert any(isinstance(m, QuantizedCPULinear) for m in model.modules())
    with pytest.raises(Exception, match="both given"):
        loaders.load_model(
            tiny_llama, device_map={"": "cpu"}, quantization="int8", cpu_quantization="int4", show_progress=False
        )
