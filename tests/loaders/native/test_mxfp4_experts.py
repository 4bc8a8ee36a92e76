"""gpt-oss's MXFP4 experts as gpt-oss ships them (``experts.gate_up_proj_blocks`` / ``_scales``, ...), written
from the tiny gpt-oss: planned to the byte from the headers, loaded on the CPU and from disk with the stored
blocks kept as stored, logits within tolerance of transformers' own load of the same checkpoint
(``Mxfp4Config(dequantize=True)``, its MXFP4 dequantizer), and refused by name where the stored tensors disagree.

Tolerance: the MXFP4 kernel rounds activations to int8 per 64 inputs, as for MXFP4 linear layers
(``test_packed_formats.py``): 3% of the largest logit. The dequantized path (where GPUs compute) is float32 exact."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from bench.quant_checkpoints import write_quantized
from loaders import load_model
from loaders.native.gpt_oss_experts import FloatGptOssExperts
from loaders.native.mxfp4_experts import Mxfp4Experts, dequantized_experts
from loaders.native.packed_formats import repack_packed_linears
from planner.errors import PlanError
from planner.model.packed_experts import PackedExperts
from planner.model.quant_config import quant_format
from planner.model.skeleton import skeleton_from_dir
from planner.placement.inputs import make_workload
from planner.placement.sizing import block_bytes, tensor_bytes
from tests.loaders.helpers import edited_checkpoint, mapped_file
from tests.models import tiny_gpt_oss_dir

TOLERANCE = 0.03
EXPERTS = "model.layers.{}.mlp.experts"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt-oss") / "mxfp4"
    return d, write_quantized(tiny_gpt_oss_dir(), d, "mxfp4")


@pytest.fixture(scope="module")
def reference(written):
    """transformers' own load of the MXFP4 checkpoint, its experts dequantized by its MXFP4 integration."""
    d, _ = written
    model = AutoModelForCausalLM.from_pretrained(
        d, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    return model.eval()


def _ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(seed))


def _within_tolerance(got: torch.Tensor, want: torch.Tensor, tol: float = TOLERANCE) -> bool:
    return bool((got - want).abs().max() <= tol * want.abs().max())


def test_written_as_gpt_oss_ships_it_and_transformers_reads_the_same_weights(written, reference):
    d, ref_sd = written
    config = json.loads((d / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "mxfp4" and "model.layers.*.self_attn" in config["modules_to_not_convert"]
    with safe_open(d / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice(EXPERTS.format(0) + ".gate_up_proj_blocks").get_shape() == [4, 128, 2, 16]
        assert f.get_slice(EXPERTS.format(0) + ".down_proj_scales").get_shape() == [4, 64, 2]
    assert EXPERTS.format(0) + ".gate_up_proj" not in keys  # only the packed form is stored
    assert "model.layers.0.self_attn.q_proj.weight" in keys  # attention stays float, as in gpt-oss
    state = reference.state_dict()
    for layer in range(4):
        for proj in ("gate_up_proj", "down_proj"):
            key = f"{EXPERTS.format(layer)}.{proj}"
            assert torch.equal(state[key].float(), ref_sd[key]), key


def test_plans_every_tensor_as_stored(written):
    d, _ = written
    skel = skeleton_from_dir(d)
    packed = [t for t in skel.tensors() if t.kind == "packed"]
    assert {t.name.rpartition(".")[2] for t in packed} == {
        "gate_up_proj_blocks",
        "gate_up_proj_scales",
        "down_proj_blocks",
        "down_proj_scales",
    }
    assert len(packed) == 16 and all(t.dtype == "uint8" for t in packed)
    with safe_open(d / "model.safetensors", "pt") as f:
        header = sum(math.prod(f.get_slice(k).get_shape()) * _itemsize(f.get_slice(k).get_dtype()) for k in f.keys())
    wl = make_workload(skel, "float32")
    nonpersistent = sum(tensor_bytes(t, wl) for t in skel.tensors() if t.kind == "buffer_nonpersistent")
    assert sum(block_bytes(b, wl, skel) for b in skel.blocks) - nonpersistent == header  # to the byte
    wl16 = make_workload(skel, "bfloat16")  # a bf16 load halves the float tensors, never the packed ones
    assert sum(tensor_bytes(t, wl16) for t in packed) == sum(tensor_bytes(t, wl) for t in packed)


def _itemsize(dtype: str) -> int:
    return {"F32": 4, "BF16": 2, "U8": 1}[dtype]


def test_loads_on_cpu_with_the_blocks_as_stored(written, reference):
    d, ref_sd = written
    model = load_model(d, device_map="cpu", dtype="float32", show_progress=False)
    for layer in range(4):
        experts = model.get_submodule(EXPERTS.format(layer))
        assert isinstance(experts, Mxfp4Experts)
        assert experts.gate_up_proj_blocks.dtype == torch.uint8
    assert model._loadmaster_packed_stats.kinds == {"mxfp4 experts": 4}
    ids = _ids(0, 12)  # longer than the sliding window of 8
    with torch.no_grad():
        assert _within_tolerance(model(ids).logits, reference(ids).logits)


def test_loads_with_layers_on_disk_reading_the_blocks_from_the_shard(written, reference, tmp_path):
    d, _ = written
    dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    dmap.update({"model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    model = load_model(d, device_map=dmap, dtype="float32", show_progress=False, offload_folder=tmp_path)
    assert model.load_stats.bytes_per_device.get("disk", 0) > 0
    on_disk = model.get_submodule(EXPERTS.format(2))
    assert isinstance(on_disk, Mxfp4Experts)
    shard = str((d / "model.safetensors").resolve())
    for t in (on_disk.gate_up_proj_blocks, on_disk.down_proj_scales):
        assert mapped_file(t.data_ptr()) == shard  # read in place from the file, not copied
    ids = _ids(1, 9)
    with torch.no_grad():
        assert _within_tolerance(model(ids).logits, reference(ids).logits)


def test_the_dequantized_form_where_gpus_compute_is_transformers_forward_exactly(written, reference):
    """Where GPUs compute, the experts are dequantized once (no native kernel there): run here on the CPU, the
    module's forward equals transformers' own experts forward on the same weights, to float32 rounding."""
    source = reference.get_submodule(EXPERTS.format(1))
    packed = _packed(written, reference, 1)
    experts = dequantized_experts(packed, torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    idx = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]])
    weights = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(3)), -1)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, idx, weights), source(x, idx, weights), rtol=1e-5, atol=1e-6)
        native = Mxfp4Experts(packed)(x, idx, weights)
        assert _within_tolerance(native, source(x, idx, weights))


def _packed(written, reference, layer: int) -> PackedExperts:
    """Layer ``layer``'s experts as the loader holds them before repacking: the stored tensors, on the CPU."""
    d, _ = written
    fmt = quant_format(json.loads((d / "config.json").read_text()))
    state = load_file(d / "model.safetensors")
    prefix = EXPERTS.format(layer) + "."
    stored = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix) and not k.endswith("_bias")}
    packed = PackedExperts(
        fmt, reference.get_submodule(EXPERTS.format(layer)), {k: (v.shape, v.dtype) for k, v in stored.items()}
    )
    for name, t in stored.items():
        setattr(packed, name, t)
    return packed


def test_experts_the_cpu_computes_beside_gpus_stay_packed_and_the_rest_are_dequantized(written, reference):
    """Where GPUs compute (``native=False``), experts kept in host RAM for the CPU to compute (the plan's
    ``experts_on_cpu``) keep their blocks for the CPU kernel rather than grow fourfold in bf16; the others are
    dequantized for their GPU."""
    root = torch.nn.Module()
    root.host = _packed(written, reference, 0)
    root.gpu = _packed(written, reference, 1)
    stats = repack_packed_linears(root, torch.bfloat16, native=False, cpu_computed=["host"])
    assert isinstance(root.host, Mxfp4Experts)
    assert isinstance(root.gpu, FloatGptOssExperts)
    assert root.gpu.gate_up_proj_weight.dtype == torch.bfloat16
    assert stats.kinds == {"mxfp4 experts": 1, "mxfp4 experts -> bfloat16": 1}


def _rewritten(written, tmp_path, change):
    return edited_checkpoint(written[0], tmp_path / "bad", change)


def test_expert_blocks_disagreeing_with_the_config_are_refused_by_name(written, tmp_path):
    key = EXPERTS.format(1) + ".down_proj_blocks"

    def flatten(state):
        state[key] = state[key].reshape(4, 64, -1).contiguous()

    with pytest.raises(PlanError, match=rf"{key} is stored as uint8 \[4, 64, 32\].*store uint8 \[4, 64, 2, 16\]"):
        skeleton_from_dir(_rewritten(written, tmp_path, flatten))


def test_expert_blocks_without_their_scales_are_refused_by_name(written, tmp_path):
    key = EXPERTS.format(3) + ".gate_up_proj_scales"
    with pytest.raises(PlanError, match=rf"{key} is missing"):
        skeleton_from_dir(_rewritten(written, tmp_path, lambda state: state.pop(key)))
