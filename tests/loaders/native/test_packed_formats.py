"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8, MXFP4, bitsandbytes int8, nf4 and fp4): planned
to the byte from their headers, loaded on the CPU and from disk with their grid repacked exactly, logits within
tolerance of the dequantized reference.

Tolerance: the native int8/int4 kernels quantize each 64-input group of activations to int8 (docs/kernels.md),
so logits of the tiny Llama differ from the float32 reference by up to ~1.5% of the largest logit; 3% is allowed.
MXFP4 layers run on a kernel that does the same (its codes are integers times a power of two): 3% as well.
FP8 layers (the FP8 kernel converts each stored byte exactly and sums in float32), bitsandbytes nf4/fp4 layers (the
float-table kernel: exact weights, float32 sums) and dequantized layers (8-bit in groups) match the float32
reference to 1e-5."""

from __future__ import annotations

import json
import math

import compressed_tensors  # noqa: F401  (a test dependency: missing, the module fails rather than skips)
import pytest
import torch
from safetensors import safe_open

from bench.quant_checkpoints import write_quantized
from loaders import load_model
from loaders.native.bnb_4bit import Bnb4CPULinear
from loaders.native.fp8_linear import Fp8CPULinear
from loaders.native.mxfp4_linear import Mxfp4CPULinear
from loaders.native.quantization import QuantizedCPULinear
from planner.errors import PlanError
from planner.model.skeleton import skeleton_from_dir
from planner.placement.inputs import make_workload
from planner.placement.sizing import block_bytes
from tests.loaders.helpers import edited_checkpoint, mapped_file
from tests.models import tiny_llama_dir

CASES = {
    "gptq4-sym": ("gptq", dict(bits=4, group=64, sym=True, act_order=False)),
    "gptq4-asym-actorder": ("gptq", dict(bits=4, group=64, sym=False, act_order=True)),
    "gptq4-v2-channel": ("gptq", dict(bits=4, group=-1, sym=False, act_order=False, v2=True)),
    "gptq8-channel": ("gptq", dict(bits=8, group=-1, sym=True, act_order=False)),
    "gptq8-group": ("gptq", dict(bits=8, group=64, sym=True, act_order=False)),
    "awq4": ("awq", dict(group=64)),
    "ct-pack4": ("ct-pack", dict(bits=4, group=64)),
    "ct-pack4-asym": ("ct-pack", dict(bits=4, group=64, sym=False)),
    "ct-pack8": ("ct-pack", dict(bits=8)),
    "ct-naive8": ("ct-int", dict(bits=8)),
    "ct-fp8": ("ct-fp8", {}),
    "fp8-block": ("fp8", {}),
    "mxfp4": ("mxfp4", {}),
    "bnb-int8": ("bnb-int8", {}),
    "bnb-nf4": ("bnb-4bit", dict(quant_type="nf4", double_quant=False)),
    "bnb-fp4": ("bnb-4bit", dict(quant_type="fp4", double_quant=False)),
    "bnb-nf4-dq": ("bnb-4bit", dict(quant_type="nf4", double_quant=True)),
    "bnb-fp4-dq": ("bnb-4bit", dict(quant_type="fp4", double_quant=True)),
}
BNB_4BIT = ("bnb-nf4", "bnb-fp4", "bnb-nf4-dq", "bnb-fp4-dq")
#: What each case's linear layers become at load.
NATIVE = {"gptq8-group": None, "ct-fp8": "fp8", "fp8-block": "fp8", "gptq8-channel": "int8", "ct-pack8": "int8"}
NATIVE["ct-naive8"] = "int8"
NATIVE["mxfp4"] = "mxfp4"
NATIVE["bnb-int8"] = "int8"
NATIVE.update({name: CASES[name][1]["quant_type"] for name in BNB_4BIT})  # linear_nf4, codes kept as stored


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    src = tiny_llama_dir()
    root = tmp_path_factory.mktemp("quant")
    return {name: (root / name, write_quantized(src, root / name, fmt, **o)) for name, (fmt, o) in CASES.items()}


def _header_bytes(d) -> int:
    with safe_open(d / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) * _size(f, k) for k in f.keys())


def _size(f, key) -> int:
    return {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "F8_E4M3": 1}[
        f.get_slice(key).get_dtype()
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_plans_every_tensor_as_stored(written, name):
    d, _ = written[name]
    skel = skeleton_from_dir(d)
    stored = {t.name: t for t in skel.tensors() if t.kind != "buffer_nonpersistent"}
    packed = [t for t in stored.values() if t.kind == "packed"]
    layers = {t.name[: t.name.index("_proj.") + 5] for t in packed}  # bnb 4-bit's names go on: weight.absmax
    assert len(layers) == 28  # every linear below the head
    for dtype in ("float32", "bfloat16"):
        wl = make_workload(skel, dtype)
        planned_packed = sum(block_bytes(b, wl, skel) for b in skel.blocks) - sum(
            _planned(t, wl) for t in skel.tensors() if t.kind != "packed"
        )
        assert planned_packed == sum(t.numel * _dtype_bytes(t.dtype) for t in packed)
    wl = make_workload(skel, "float32")  # the stored dtype of the rest: every byte as stored
    nonpersistent = sum(_planned(t, wl) for t in skel.tensors() if t.kind == "buffer_nonpersistent")
    assert sum(block_bytes(b, wl, skel) for b in skel.blocks) - nonpersistent == _header_bytes(d)


def _planned(t, wl) -> int:
    from planner.placement.sizing import tensor_bytes

    return tensor_bytes(t, wl)


def _dtype_bytes(dtype: str) -> int:
    from planner.types import DTYPE_BYTES

    return int(DTYPE_BYTES[dtype])


def _reference_logits(ref_sd, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(), dtype=torch.float32)
    model.load_state_dict(ref_sd, strict=False)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", list(CASES))
def test_loads_on_cpu_with_the_grid_repacked_exactly(written, name):
    d, ref_sd = written[name]
    model = load_model(d, device_map="cpu", dtype="float32", show_progress=False)
    for mname, mod in model.named_modules():
        if not mname.endswith(("_proj",)):
            continue
        kind = NATIVE.get(name, "int4")
        if name == "gptq8-group" and mod.in_features <= 64:  # one group spans the row: per channel after all
            kind = "int8"
        want = ref_sd[f"{mname}.weight"]
        if kind == "fp8":  # the stored bytes, kept as stored; their scales exactly
            assert isinstance(mod, Fp8CPULinear) and mod.weight.dtype == torch.float8_e4m3fn, mname
            assert torch.equal(mod.dequantized_weight(torch.float32), want), mname
            continue
        if kind == "mxfp4":  # the stored blocks and scale bytes, kept as stored: transformers' dequantized weight
            assert isinstance(mod, Mxfp4CPULinear) and mod.blocks.dtype == torch.uint8, mname
            assert torch.equal(mod.dequantized_weight(torch.float32), want), mname
            continue
        if name in BNB_4BIT:  # the stored codes, kept as stored: bitsandbytes' dequantize_4bit, bit for bit
            assert isinstance(mod, Bnb4CPULinear) and mod.codes.dtype == torch.uint8, mname
            assert torch.equal(mod.dequantized_weight(torch.float32), want), mname
            continue
        if kind is None:
            assert type(mod) is torch.nn.Linear or not isinstance(mod, QuantizedCPULinear)
            torch.testing.assert_close(mod.weight.float(), want, rtol=0, atol=1e-6)
            continue
        assert isinstance(mod, QuantizedCPULinear) and mod.scheme == kind, mname
        got = mod.dequantized_weight(torch.float32)
        if kind == "int4":
            assert torch.equal(got, want), mname  # bit for bit
        elif name == "bnb-int8":  # bitsandbytes' codes as they are; SCB / 127 against its own SCB * (1/127)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        else:  # codes of -128 become -127: at most one step, nothing else moves
            step = mod.scales[:, None]
            assert ((got - want).abs() <= step * 1.0001).all() and (got != want).float().mean() < 0.01
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
    want = _reference_logits(ref_sd, ids)
    tol = 1e-5 if (NATIVE.get(name, "int4") in (None, "fp8") and name != "gptq8-group") or name in BNB_4BIT else 0.03
    assert (got - want).abs().max() <= tol * want.abs().max()
    if NATIVE.get(name) in ("fp8", "mxfp4"):
        assert model._loadmaster_packed_stats.kinds == {NATIVE[name]: 28}
    if name in BNB_4BIT:
        assert model._loadmaster_packed_stats.kinds == {NATIVE[name]: 28}


@pytest.mark.parametrize(
    "name", ["gptq4-asym-actorder", "awq4", "fp8-block", "ct-fp8", "mxfp4", "bnb-int8", "bnb-nf4-dq", "bnb-fp4"]
)
def test_loads_with_layers_on_disk(written, name, tmp_path):
    d, ref_sd = written[name]
    dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    dmap.update({"model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    model = load_model(d, device_map=dmap, dtype="float32", show_progress=False, offload_folder=tmp_path)
    assert model.load_stats.bytes_per_device.get("disk", 0) > 0
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
    want = _reference_logits(ref_sd, ids)
    tol = 1e-5 if NATIVE.get(name) == "fp8" or name in BNB_4BIT else 0.03
    assert (got - want).abs().max() <= tol * want.abs().max()
    if NATIVE.get(name) == "fp8":  # a disk layer's kernel reads the stored bytes from the shard's map, in place
        on_disk = model.model.layers[1].mlp.down_proj
        assert isinstance(on_disk, Fp8CPULinear)
        assert mapped_file(on_disk.weight.data_ptr()) == str((d / "model.safetensors").resolve())
    if NATIVE.get(name) == "mxfp4":  # likewise the MXFP4 blocks and scales
        on_disk = model.model.layers[2].self_attn.o_proj
        assert isinstance(on_disk, Mxfp4CPULinear)
        for t in (on_disk.blocks, on_disk.scales):
            assert mapped_file(t.data_ptr()) == str((d / "model.safetensors").resolve())
        assert isinstance(model.model.layers[0].mlp.down_proj, Mxfp4CPULinear)
    if name in BNB_4BIT:  # the codes likewise (and the absmax where stored as float32, without double quant)
        on_disk = model.model.layers[1].self_attn.q_proj
        assert isinstance(on_disk, Bnb4CPULinear)
        shard = str((d / "model.safetensors").resolve())
        assert mapped_file(on_disk.codes.data_ptr()) == shard
        assert (mapped_file(on_disk.absmax.data_ptr()) == shard) == (not CASES[name][1]["double_quant"])


def _with_config(written, name, tmp_path, **change):
    import shutil

    d, _ = written[name]
    out = tmp_path / "bad"
    shutil.copytree(d, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    ("name", "change", "field"),
    [
        ("gptq4-sym", {"quant_method": "sparse-magic"}, "quant_method"),
        ("gptq4-sym", {"quant_method": "hqq"}, "quant_method"),
        ("bnb-int8", {"load_in_8bit": False}, "load_in_8bit"),
        ("bnb-nf4", {"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type"),
        ("bnb-nf4", {"bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage"),
        ("mxfp4", {"block_size": 16}, "block_size"),
        ("gptq4-sym", {"bits": 3}, "bits"),
        ("gptq4-sym", {"group_size": 32}, "group_size"),
        ("awq4", {"version": "gemv"}, "version"),
        ("fp8-block", {"weight_block_size": None}, "weight_block_size"),
        ("gptq4-sym", {"bits": 8}, "model.layers.0.self_attn.q_proj.qweight"),  # packed shapes disagree
    ],
)
def test_unsupported_configs_name_the_field(written, tmp_path, name, change, field):
    d = _with_config(written, name, tmp_path, **change)
    with pytest.raises(PlanError, match=f"{field}.*supported|{field} is stored as"):
        skeleton_from_dir(d)


def test_mxfp4_blocks_disagreeing_with_the_layer_are_refused(written, tmp_path):
    """Blocks stored flat (``[N, K/2]``, not gpt-oss's ``[N, K/32, 16]``): the plan names the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    d, _ = written["mxfp4"]
    out = tmp_path / "flat"
    shutil.copytree(d, out)
    state = load_file(out / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight_blocks"
    state[key] = state[key].reshape(state[key].shape[0], -1).contiguous()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PlanError, match=f"{key} is stored as"):
        skeleton_from_dir(out)


def test_mxfp4_in_features_must_be_whole_blocks():
    from planner.model.quant_config import check_stored_shapes, quant_format

    fmt = quant_format({"quantization_config": {"quant_method": "mxfp4"}})
    assert fmt is not None and fmt.describe == "mxfp4 e2m1 blocks of 32"
    with pytest.raises(PlanError, match=r"layers\.0\.mlp\.down_proj\.weight_blocks.*in_features=100.*multiple of 32"):
        check_stored_shapes(fmt, "layers.0.mlp.down_proj", 64, 100, {"weight_blocks": (64, 3, 16)})


def test_mxfp4_expert_blocks_of_no_linear_layer_are_refused(written, tmp_path):
    """``experts.gate_up_proj_blocks`` under a Llama, which has no experts module to hold them (gpt-oss's own are
    ``test_mxfp4_experts.py``'s): nothing would load them, so the plan says so."""
    import shutil

    from safetensors.torch import load_file, save_file

    d, _ = written["mxfp4"]
    out = tmp_path / "experts"
    shutil.copytree(d, out)
    state = load_file(out / "model.safetensors")
    state["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(2, 8, 2, 16, dtype=torch.uint8)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PlanError, match="experts.gate_up_proj_blocks: MXFP4 blocks of something other"):
        skeleton_from_dir(out)


def _kernel_of(mod: torch.nn.Module) -> str:
    """The kernel a loaded linear layer runs on, named as plans name it (planner.placement.tier_kernels)."""
    if isinstance(mod, Fp8CPULinear):
        return "linear_fp8"
    if isinstance(mod, Mxfp4CPULinear):
        return "linear_mxfp4"
    if isinstance(mod, Bnb4CPULinear):
        return "linear_nf4"
    if isinstance(mod, QuantizedCPULinear):
        return "linear_q4z" if mod.zeros is not None else f"linear_q{mod.scheme.removeprefix('int')}"
    return "none: int8 in groups is dequantized"


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_names_the_kernel_the_layers_load_on(written, name):
    """The plan's kernel for the CPU tier is the one every quantized layer of the load runs on."""
    from planner.api import plan

    d, _ = written[name]
    said = plan(d, max_memory={"cpu": "1GiB"}, dtype="float32").kernels
    assert list(said) == ["cpu"]
    model = load_model(d, device_map="cpu", dtype="float32", show_progress=False)
    kernels = {
        _kernel_of(mod)
        for mname, mod in model.named_modules()
        if mname.endswith("_proj") and not (name == "gptq8-group" and mod.in_features <= 64)
    }
    assert len(kernels) == 1 and said["cpu"].startswith(kernels.pop()), (said, kernels)


def _rewritten(written, name, tmp_path, change) -> object:
    """A copy of checkpoint ``name`` whose state dict ``change`` edited in place."""
    return edited_checkpoint(written[name][0], tmp_path / "edited", change)


def test_bnb_4bit_quant_state_of_another_type_than_the_config_is_refused(written, tmp_path):
    """An fp4 checkpoint whose config says nf4: the plan names the stored blob and the field to fix."""
    d = _with_config(written, "bnb-fp4", tmp_path, bnb_4bit_quant_type="nf4")
    with pytest.raises(
        PlanError, match=r"q_proj\.weight\.quant_state\.bitsandbytes__fp4 is stored.*bnb_4bit_quant_type"
    ):
        skeleton_from_dir(d)


def test_bnb_4bit_absmax_of_no_bitsandbytes_block_size_is_refused(written, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight.absmax"

    def cut(state):
        state[key] = state[key][:-3].contiguous()

    with pytest.raises(PlanError, match=rf"{key} is stored as .*blocks of"):
        skeleton_from_dir(_rewritten(written, "bnb-nf4", tmp_path, cut))


def test_bnb_4bit_layer_without_its_quant_state_is_refused(written, tmp_path):
    key = "model.layers.0.self_attn.o_proj.weight.quant_state.bitsandbytes__nf4"
    with pytest.raises(PlanError, match=rf"{key} is missing"):
        skeleton_from_dir(_rewritten(written, "bnb-nf4-dq", tmp_path, lambda state: state.pop(key)))


DISK_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
DISK_MAP.update({"model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})


@pytest.mark.parametrize("name", ["gptq4-asym-actorder", "awq4", "ct-naive8"])
def test_repacked_layers_are_saved_once_and_mapped_from_the_file(written, name, tmp_path):
    d, _ = written[name]
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(2))
    logits, files = [], []
    for _ in range(2):
        model = load_model(d, device_map=DISK_MAP, dtype="float32", show_progress=False, cpu_quantized_dir=tmp_path)
        stats = model._loadmaster_packed_stats
        files.append((stats.file, stats.from_file))
        with torch.no_grad():
            logits.append(model(ids).logits)
        saved = str((tmp_path / stats.file.rpartition("/")[2]).resolve())
        for layer in (model.model.layers[0].mlp.down_proj, model.model.layers[1].self_attn.q_proj):
            assert isinstance(layer, QuantizedCPULinear)
            assert mapped_file(layer.qweight.data_ptr()) == saved  # resident and disk layers alike: the file's map
            assert mapped_file(layer.scales.data_ptr()) == saved
        # the disk layers' readahead reads the saved file's ranges, not the stored tensors it no longer reads
        assert any(k.startswith("model.layers.1.") for k in stats.file_ranges)
        assert all(path == saved for path, _, _ in stats.file_ranges.values())
    assert files[0][1] is False and files[1] == (files[0][0], True)
    assert torch.equal(logits[0], logits[1])
    loaded = load_model(d, device_map=DISK_MAP, dtype="float32", show_progress=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits[0])  # the same weights as a load that repacks in memory


def test_a_repacked_file_for_another_checkpoint_or_damaged_is_not_read(written, tmp_path, caplog):
    import os
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(written["gptq4-sym"][0], d)
    first = load_model(
        d, device_map={"": "cpu"}, dtype="float32", show_progress=False, cpu_quantized_dir=tmp_path / "c"
    )
    path = first._loadmaster_packed_stats.file
    del first
    shard = d / "model.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # the checkpoint changed
    again = load_model(
        d, device_map={"": "cpu"}, dtype="float32", show_progress=False, cpu_quantized_dir=tmp_path / "c"
    )
    assert again._loadmaster_packed_stats.file != path and not again._loadmaster_packed_stats.from_file
    path = again._loadmaster_packed_stats.file
    del again
    with open(path, "r+b") as fh:  # a damaged header: ignored with a warning, repacked and saved whole again
        fh.write(b"\xff" * 16)
    with caplog.at_level("WARNING", logger="loaders.native.quantization"):
        third = load_model(
            d, device_map={"": "cpu"}, dtype="float32", show_progress=False, cpu_quantized_dir=tmp_path / "c"
        )
    assert not third._loadmaster_packed_stats.from_file
    assert "ignoring the repacked file" in caplog.text
    assert isinstance(third.model.layers[0].self_attn.q_proj, QuantizedCPULinear)


def test_disk_layers_repacked_into_memory_are_said(written, caplog):
    with caplog.at_level("WARNING", logger="loaders.native.packed_formats"):
        model = load_model(written["awq4"][0], device_map=DISK_MAP, dtype="float32", show_progress=False)
    assert "planned on disk were repacked into memory" in caplog.text and "--cpu-quantized-dir" in caplog.text
    assert model._loadmaster_packed_stats.file_ranges == {}


def test_a_folder_without_cpu_quantization_is_refused_for_a_checkpoint_not_quantized(tmp_path):
    with pytest.raises(PlanError, match="not pre-quantized"):
        load_model(tiny_llama_dir(), device_map={"": "cpu"}, show_progress=False, cpu_quantized_dir=tmp_path)
