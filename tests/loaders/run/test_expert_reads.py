"""Routed experts on disk, read per hit expert (a host without GPUs): the block readahead leaves the experts' fused
tensors out, and a pre-hook on each disk experts module reads exactly the slices of the experts its tokens were
sent to, for gpt-oss's MXFP4 experts and for Mixtral's float ones; the logits stay those of the model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import loaders
from bench.quant_checkpoints import write_quantized
from planner.api import plan
from planner.placement.cost_model import block_read_seconds
from planner.placement.sizing import SizedBlock
from tests.loaders.helpers import assert_equivalent
from tests.models import tiny_gpt_oss_dir

ON_DISK = ("model.layers.1", "model.layers.2")


def _disk_map() -> dict:
    dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.3": "cpu"}
    dmap.update({k: "disk" for k in ON_DISK})
    dmap.update({"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    return dmap


def _check_reads_per_hit_expert(model, top_k: int) -> None:
    reads = model._loadmaster_expert_reads
    assert set(reads.modules) == {f"{k}.mlp.experts" for k in ON_DISK}
    block_ranges = [r for _, rs in model._loadmaster_readahead.blocks for r in rs]
    for _, ranges in reads.modules.values():
        for r in ranges:  # no block range reads an expert's slice (one under a page may be bridged)
            big = r.per_expert * model.get_submodule(r.tensor.rpartition(".")[0]).num_experts >= 8192
            assert not big or not any(p == r.path and s <= r.start < e for p, s, e in block_ranges), r
    before = reads.bytes_read
    with torch.no_grad():
        model(torch.tensor([[7]]))  # one token: top_k distinct experts in each MoE layer
    per_token = sum(top_k * r.per_expert for _, ranges in reads.modules.values() for r in ranges)
    assert reads.bytes_read - before == per_token
    whole = sum(n * r.per_expert for n, ranges in reads.modules.values() for r in ranges)
    assert per_token < whole


def test_gpt_oss_mxfp4_experts_on_disk_read_only_the_hit_experts(tmp_path):
    d = tmp_path / "mxfp4"
    write_quantized(tiny_gpt_oss_dir(), d, "mxfp4")
    model = loaders.load_model(d, device_map=_disk_map(), dtype="float32", show_progress=False, offload_folder=tmp_path)
    _check_reads_per_hit_expert(model, top_k=2)


@pytest.mark.parametrize("fixture", ["tiny_moe", "tiny_qwen_moe"])
def test_float_experts_on_disk_read_only_the_hit_experts_and_match_transformers(fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    model = loaders.load_model(path, device_map=_disk_map(), show_progress=False, offload_folder=tmp_path)
    _check_reads_per_hit_expert(model, top_k=model.config.num_experts_per_tok)
    assert_equivalent(model, path)


def test_the_cost_model_reads_a_disk_moe_layer_by_its_touched_experts_only_without_gpus():
    """A disk MoE layer the CPU computes reads its touched experts (read_per_token); streamed to a GPU, the whole
    layer is copied."""
    layer = SizedBlock("model.layers.1", 800, 0, False, False, True, read_per_token=300, stream_per_token=800)
    assert block_read_seconds(layer, "disk", "cpu", 100.0, None) == pytest.approx(3.0)
    assert block_read_seconds(layer, "disk", 0, 100.0, None) == pytest.approx(8.0)


@pytest.mark.parametrize("cached", [True, False])
def test_disk_pages_are_kept_or_given_back_as_the_plan_took_them(cached, tmp_path):
    """The plan's cost model takes its disk share as cached between tokens or not (Prediction.disk_cached); the
    loader's block readahead and hit-expert reads keep their pages or give them back to match, whatever memory
    the host has free now (a device map without a plan is judged by that)."""
    path = tiny_gpt_oss_dir()
    p = plan(str(path), strategy=_disk_map(), max_memory={"cpu": "8GiB", "disk": "64GiB"})
    assert p.prediction.disk_cached is True  # the disk share fits the RAM the plan leaves free
    p = replace(p, prediction=replace(p.prediction, disk_cached=cached))
    model = loaders.load_model(path, device_map=p, show_progress=False, offload_folder=tmp_path)
    assert model._loadmaster_expert_reads.drop_behind is not cached
    assert model._loadmaster_readahead.drop_behind is not cached
