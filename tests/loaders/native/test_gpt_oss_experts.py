"""gpt-oss's float experts (a bf16 or fp32 checkpoint's) computed on the native float kernel: laid out [E, N, K] once
at load where they are resident, left as stored on disk, and the logits and greedy tokens those of transformers."""

from __future__ import annotations

import pytest
import torch

import loaders
from loaders.native import operators
from loaders.native.gpt_oss_experts import FloatGptOssExperts
from tests.loaders.helpers import assert_equivalent
from tests.models import tiny_gpt_oss_dir

EXPERTS = "model.layers.{}.mlp.experts"


def _experts(model) -> list[torch.nn.Module]:
    return [model.get_submodule(EXPERTS.format(i)) for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_experts_run_the_native_kernel_and_match_transformers(native_path, dtype):
    path = tiny_gpt_oss_dir()
    model = loaders.load_model(path, device_map={"": "cpu"}, dtype=dtype, show_progress=False)
    experts = _experts(model)
    assert all(isinstance(e, FloatGptOssExperts) for e in experts)
    e = experts[0]
    n, k = 2 * e.intermediate_size, e.hidden_size
    assert tuple(e.gate_up_proj_weight.shape) == (e.num_experts, n, k)
    x = torch.randn(1, k, dtype=e.gate_up_proj_weight.dtype)
    assert operators.supports(x, e.gate_up_proj_weight[0])  # a decode row: the native kernel's product
    assert_equivalent(model, path, dtype)


def test_disk_experts_stay_as_stored_and_the_model_matches_transformers(native_path, tmp_path):
    path = tiny_gpt_oss_dir()
    dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    dmap.update({"model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    model = loaders.load_model(path, device_map=dmap, show_progress=False, offload_folder=tmp_path)
    kinds = [type(e).__name__ for e in _experts(model)]
    assert kinds == ["FloatGptOssExperts", "GptOssExperts", "GptOssExperts", "FloatGptOssExperts"]
    assert_equivalent(model, path)


def test_torch_kernels_keep_transformers_experts():
    model = loaders.load_model(tiny_gpt_oss_dir(), device_map={"": "cpu"}, show_progress=False, cpu_kernels="torch")
    assert {type(e).__name__ for e in _experts(model)} == {"GptOssExperts"}
