"""Loaded models compute exactly what plain transformers computes on the same weights, under every kind of map."""

from __future__ import annotations

import ctypes

import pytest
import torch

import loaders
import planner
from tests.loaders.helpers import assert_equivalent, smaps_bytes

FIXTURES = ["tiny_llama", "tiny_gpt2", "tiny_moe"]

# Custom maps that mix resident and disk-served modules (disk in the stored dtype: zero-copy memory maps).
CUSTOM_MAPS = {
    "tiny_llama": {
        "model.embed_tokens": "disk",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.layers.3": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "disk",
        "lm_head": "disk",
    },
    # lm_head is tied to transformer.wte: it must end up as the very same tensor.
    "tiny_gpt2": {"transformer.h.1": "disk", "transformer.h.3": "disk", "transformer.wpe": "disk", "": "cpu"},
    # Fused experts on disk cannot be views of per-expert keys: they go through the offload folder.
    "tiny_moe": {"model.layers.0": "disk", "model.layers.2.self_attn": "disk", "lm_head": "disk", "": "cpu"},
}


def _load(path, device_map, tmp_path, **kw):
    return loaders.load_model(
        path, device_map=device_map, offload_folder=tmp_path / "offload", show_progress=False, **kw
    )


@pytest.mark.parametrize("fixture", FIXTURES)
def test_all_cpu(fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    model = _load(path, {"": "cpu"}, tmp_path)
    assert model.hf_device_map == {"": "cpu"}
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_equivalent(model, path)
    assert model.load_stats.offload_bytes_written == 0
    assert model.load_stats.bytes_per_device.get("disk", 0) == 0


@pytest.mark.parametrize("strategy", ["sequential", "balanced"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_planner_strategies_split_over_cpu_and_disk(fixture, strategy, request, tmp_path):
    path = request.getfixturevalue(fixture)
    mm = {"cpu": 900_000, "disk": "1GiB"}
    model = _load(path, strategy, tmp_path, max_memory=mm, context=32)
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}, model.hf_device_map
    expected = planner.plan(
        str(path), max_memory=mm, strategy=strategy, dtype="float32", context=32, offload_folder=tmp_path / "offload"
    ).device_map
    assert model.hf_device_map == expected
    assert model.load_stats.bytes_per_device["disk"] > 0
    assert_equivalent(model, path)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_custom_map_mixing_cpu_and_disk(fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    model = _load(path, CUSTOM_MAPS[fixture], tmp_path)
    assert model.hf_device_map == CUSTOM_MAPS[fixture]
    assert_equivalent(model, path)


def test_everything_on_disk(tiny_llama, tmp_path):
    model = _load(tiny_llama, {"": "disk"}, tmp_path)
    stats = model.load_stats
    assert stats.bytes_per_device == {"disk": stats.zero_copy_bytes}
    assert stats.bytes_read == 0 and stats.offload_bytes_written == 0
    assert not (tmp_path / "offload").exists()  # nothing was re-saved
    assert_equivalent(model, tiny_llama)


def _mapped_ranges(model):
    out = []
    for mm in model._loadmaster_reader.maps.values():
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        out.append((addr, addr + len(mm)))
    return out


def _shard_rss(model) -> int:
    """Bytes of the shards' memory maps that are mapped into this process now (smaps Rss of those mappings)."""
    ranges = _mapped_ranges(model)
    return smaps_bytes("Rss", lambda lo, _line: any(a <= lo < b for a, b in ranges))


def test_disk_tensors_are_views_of_the_shards_and_cpu_ones_private_copies(tiny_llama, tmp_path):
    """Disk weights are read in place (zero-copy views of the shard maps); resident weights are copies in the
    process's own memory, which a shard changed on disk cannot reach (issue 38)."""
    dm = CUSTOM_MAPS["tiny_llama"]
    model = _load(tiny_llama, dm, tmp_path)
    ranges = _mapped_ranges(model)
    on_disk = model.model.layers[1].self_attn.q_proj.weight
    resident = model.model.layers[0].self_attn.q_proj.weight
    assert any(lo <= on_disk.data_ptr() < hi for lo, hi in ranges), "stored-dtype disk tensors are zero-copy views"
    assert not any(lo <= resident.data_ptr() < hi for lo, hi in ranges), "a resident tensor lives in its own memory"
    stats = model.load_stats
    assert stats.offload_bytes_written == 0 and stats.bytes_read == stats.bytes_per_device["cpu"] > 0
    assert stats.zero_copy_bytes == stats.bytes_per_device["disk"] > 0
    assert_equivalent(model, tiny_llama)


def test_cpu_share_is_resident_at_ready_and_disk_share_is_not(tiny_llama, tmp_path):
    resident = _load(tiny_llama, {"": "cpu"}, tmp_path)
    assert not resident._loadmaster_reader.maps  # copied by reads: no shard is mapped at all
    on_disk = _load(tiny_llama, {"": "disk"}, tmp_path)
    assert _shard_rss(on_disk) < on_disk.load_stats.bytes_per_device["disk"] // 4  # nothing touched yet
    with torch.no_grad():
        on_disk(torch.tensor([[1, 2, 3]]))
    assert _shard_rss(on_disk) >= on_disk.load_stats.bytes_per_device["disk"] // 2  # paged in by use


def test_gpt2_head_stays_tied(tiny_gpt2, tmp_path):
    model = _load(tiny_gpt2, CUSTOM_MAPS["tiny_gpt2"], tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_moe_fused_experts_match_transformers_layout(tiny_moe, tmp_path):
    from tests.loaders.helpers import reference_model

    model = _load(tiny_moe, {"": "cpu"}, tmp_path)
    ref = reference_model(str(tiny_moe))
    for name, p in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name


def test_moe_disk_share_goes_through_offload_folder_once(tiny_moe, tmp_path):
    dm = CUSTOM_MAPS["tiny_moe"]
    first = _load(tiny_moe, dm, tmp_path)
    assert first.load_stats.offload_bytes_written > 0
    assert (tmp_path / "offload" / "index.json").is_file()
    second = _load(tiny_moe, dm, tmp_path)
    assert second.load_stats.offload_bytes_written == 0  # reused, validated
    assert_equivalent(second, tiny_moe)


def test_cast_to_bfloat16_with_disk_share(tiny_llama, tmp_path):
    dm = {"model.layers.2": "disk", "model.layers.3": "disk", "": "cpu"}
    # torch's kernels, so that the bf16 comparison is exact: this checks the loaded values, not the native
    # kernel's summation order (tests/loaders/native/test_kernel_build.py checks that, within bf16 rounding)
    model = _load(tiny_llama, dm, tmp_path, dtype="bfloat16", cpu_kernels="torch")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.load_stats.offload_bytes_written > 0  # fp32 on disk must be cast once
    assert_equivalent(model, tiny_llama, dtype="bfloat16")
    again = _load(tiny_llama, dm, tmp_path, dtype="bfloat16")
    assert again.load_stats.offload_bytes_written == 0


def test_obeys_a_plan_exactly(tiny_llama, tmp_path):
    p = planner.plan(
        str(tiny_llama),
        max_memory={"cpu": 900_000, "disk": "1GiB"},
        strategy="sequential",
        dtype="float32",
        context=32,
        offload_folder=tmp_path / "offload",
    )
    p = planner.Plan.from_json(p.to_json())  # as handed over by /plan
    model = loaders.load_model(tiny_llama, device_map=p, offload_folder=tmp_path / "offload", show_progress=False)
    assert model.hf_device_map == p.device_map
    assert model.loadmaster_plan is p
    assert_equivalent(model, tiny_llama)


def test_progress_reports_every_byte_in_order(tiny_gpt2, tmp_path):
    seen = []
    model = loaders.load_model(
        tiny_gpt2,
        device_map={"transformer.h.0": "disk", "": "cpu"},
        offload_folder=tmp_path / "o",
        progress=seen.append,
        show_progress=False,
    )
    done = [p.bytes_done for p in seen]
    assert done == sorted(done)
    assert seen[-1].phase == "ready" and seen[-1].bytes_done == seen[-1].bytes_total
    assert seen[-1].bytes_total == sum(model.load_stats.bytes_per_device.values())
    assert {"loading", "dispatching"} <= {p.phase for p in seen}
    assert seen[-1].bytes_per_device.get("disk", 0) > 0 and seen[-1].bytes_per_device.get("cpu", 0) > 0
    assert seen[-1].bytes_per_second > 0


def test_load_model_and_tokenizer(tiny_llama):
    model, tok = loaders.load_model_and_tokenizer(tiny_llama, device_map={"": "cpu"}, show_progress=False)
    ids = tok("hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    assert model.load_stats.seconds > 0 and model.load_stats.peak_rss_bytes > 0


@pytest.fixture(scope="module")
def tiny_qwen_moe(tmp_path_factory):
    """A Qwen2-MoE checkpoint: per-expert gate_proj/up_proj/down_proj keys plus a shared expert."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen-moe")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, max_shard_size="30KB")
    return path


def test_qwen_moe_expert_spelling(tiny_qwen_moe, tmp_path):
    model = _load(tiny_qwen_moe, {"model.layers.1": "disk", "": "cpu"}, tmp_path)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 48, 32)
    assert_equivalent(model, tiny_qwen_moe)


def _hooked(model):
    return {n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks}


def test_cpu_modules_carry_no_hooks(tiny_llama, tmp_path):
    assert _hooked(_load(tiny_llama, {"": "cpu"}, tmp_path)) == set()
    mixed = _load(tiny_llama, CUSTOM_MAPS["tiny_llama"], tmp_path)
    # one readahead pre-hook per disk block that holds weights, nothing else; an embedding on disk is looked up
    # from the shard's map, a row a token, and never read ahead whole
    lookups = ("model.rotary_emb", "model.embed_tokens")
    disk_entries = {k for k, v in CUSTOM_MAPS["tiny_llama"].items() if v == "disk" and k not in lookups}
    assert _hooked(mixed) == disk_entries
