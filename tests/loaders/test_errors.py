"""Every way a checkpoint, a device map or an offload folder can be wrong raises before a model is returned."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import loaders
from loaders import CheckpointError
from loaders.checkpoint.offload_folder import DATA, INDEX
from planner.errors import PlanError
from tests.loaders.helpers import assert_equivalent, copy_checkpoint

INDEX_JSON = "model.safetensors.index.json"


def _shard_of(ckpt: Path, key: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX_JSON).read_text())["weight_map"][key]


def _edit_shard(ckpt: Path, shard: Path, edit) -> None:
    """Rewrite one shard through ``edit(dict) -> dict`` and keep the index consistent with it."""
    tensors = load_file(shard)
    old = set(tensors)
    tensors = edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((ckpt / INDEX_JSON).read_text())
    for k in old - set(tensors):
        index["weight_map"].pop(k)
    for k in set(tensors) - old:
        index["weight_map"][k] = shard.name
    (ckpt / INDEX_JSON).write_text(json.dumps(index))


@pytest.fixture
def ckpt(tiny_llama, tmp_path) -> Path:
    return copy_checkpoint(tiny_llama, tmp_path / "ckpt")


def _load(path, **kw):
    kw.setdefault("device_map", {"": "cpu"})
    return loaders.load_model(path, show_progress=False, **kw)


def test_missing_key_is_listed(ckpt):
    key = "model.layers.2.mlp.up_proj.weight"
    _edit_shard(ckpt, _shard_of(ckpt, key), lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match="missing keys.*model.layers.2.mlp.up_proj.weight") as e:
        _load(ckpt)
    assert e.value.error_type == "checkpoint"


def test_unexpected_key_is_listed(ckpt):
    key = "model.layers.0.input_layernorm.weight"
    _edit_shard(ckpt, _shard_of(ckpt, key), lambda t: {**t, "model.layers.0.extra_gate.weight": torch.ones(4)})
    with pytest.raises(CheckpointError, match=r"unexpected keys.*model\.layers\.0\.extra_gate\.weight"):
        _load(ckpt)


def test_shape_mismatch_is_listed(ckpt):
    key = "model.layers.1.self_attn.k_proj.weight"
    _edit_shard(ckpt, _shard_of(ckpt, key), lambda t: {**t, key: torch.zeros(3, 5)})
    with pytest.raises(CheckpointError, match=r"shape mismatches.*k_proj\.weight \(checkpoint \[3, 5\]"):
        _load(ckpt)


def test_shard_truncated_mid_tensor(ckpt):
    shard = _shard_of(ckpt, "model.layers.1.self_attn.k_proj.weight")
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)  # the last tensor now ends past the end of the file
    with pytest.raises(CheckpointError, match=shard.name):
        _load(ckpt, device_map={"": "disk"}, offload_folder=ckpt.parent / "o")


def test_corrupt_header_json(ckpt):
    shard = _shard_of(ckpt, "model.embed_tokens.weight")
    with open(shard, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8)
        f.write(b"}" * min(n, 16))
    with pytest.raises(CheckpointError, match="JSON"):
        _load(ckpt)


def test_corrupt_header_length(ckpt):
    shard = _shard_of(ckpt, "model.embed_tokens.weight")
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", 10**12))
    with pytest.raises(CheckpointError, match=shard.name):
        _load(ckpt)


def test_index_names_a_missing_file(ckpt):
    shard = _shard_of(ckpt, "model.norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        _load(ckpt)


def test_unknown_module_in_map_suggests_names(tiny_llama):
    with pytest.raises(PlanError, match=r"model\.layer\.1.*did you mean.*model\.layers\.1"):
        _load(tiny_llama, device_map={"model.layer.1": "disk", "": "cpu"})


def test_map_leaving_tensors_without_device(tiny_llama):
    with pytest.raises(PlanError, match="without a device"):
        _load(tiny_llama, device_map={"model.layers": "cpu", "lm_head": "cpu"})


def test_gpu_in_map_without_cuda(tiny_llama):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(PlanError, match="no CUDA device"):
        _load(tiny_llama, device_map={"": 0})


def test_unknown_strategy(tiny_llama):
    with pytest.raises(PlanError, match="Unknown device_map strategy"):
        _load(tiny_llama, device_map="fastest")


# -- offload folder ----------------------------------------------------------------------------------------

BF16_DISK = {"model.layers.3": "disk", "": "cpu"}


def test_offload_folder_of_another_model_is_refused(tiny_llama, tiny_gpt2, tmp_path):
    folder = tmp_path / "offload"
    loaders.load_model(
        tiny_gpt2,
        device_map={"transformer.h.3": "disk", "": "cpu"},
        dtype="bfloat16",
        offload_folder=folder,
        show_progress=False,
    )
    before = (folder / DATA).read_bytes()
    with pytest.raises(CheckpointError, match="belongs to another model"):
        loaders.load_model(
            tiny_llama, device_map=BF16_DISK, dtype="bfloat16", offload_folder=folder, show_progress=False
        )
    assert (folder / DATA).read_bytes() == before  # never overwritten silently


def test_offload_folder_from_an_interrupted_run_is_rewritten(tiny_llama, tmp_path, monkeypatch):
    folder = tmp_path / "offload"
    from loaders.checkpoint import materialize

    calls = {"n": 0}
    real = materialize.Materializer._load_cpu

    def dies_midway(self, src, dtype, pin=False, device="cpu"):
        if self.reporter.phase == "offloading":
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt  # the run is killed while writing the offload folder
        return real(self, src, dtype, pin, device)

    monkeypatch.setattr(materialize.Materializer, "_load_cpu", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        loaders.load_model(
            tiny_llama, device_map=BF16_DISK, dtype="bfloat16", offload_folder=folder, show_progress=False
        )
    monkeypatch.undo()
    assert not (folder / INDEX).exists(), "an interrupted write must not leave an index behind"
    assert not list(folder.glob("*.tmp")), "a failed run removes its temporary files (issue 38)"
    model = loaders.load_model(
        tiny_llama,
        device_map=BF16_DISK,
        dtype="bfloat16",
        offload_folder=folder,
        show_progress=False,
        cpu_kernels="torch",
    )  # exact bf16 comparison below
    assert model.load_stats.offload_bytes_written > 0
    assert not list(folder.glob("*.tmp"))
    assert_equivalent(model, tiny_llama, dtype="bfloat16")


def test_offload_folder_with_truncated_data_is_rewritten(tiny_llama, tmp_path):
    folder = tmp_path / "offload"
    # torch's kernels: the bf16 comparison below is exact (it checks the values loaded, not the kernel)
    kw = dict(device_map=BF16_DISK, dtype="bfloat16", offload_folder=folder, show_progress=False, cpu_kernels="torch")
    loaders.load_model(tiny_llama, **kw)
    with open(folder / DATA, "r+b") as f:
        f.truncate(100)
    model = loaders.load_model(tiny_llama, **kw)
    assert model.load_stats.offload_bytes_written > 0
    assert_equivalent(model, tiny_llama, dtype="bfloat16")


def test_offload_folder_is_rewritten_when_the_checkpoint_changes(tiny_llama, tmp_path):
    ckpt = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    folder = tmp_path / "offload"
    kw = dict(device_map=BF16_DISK, dtype="bfloat16", offload_folder=folder, show_progress=False)
    loaders.load_model(ckpt, **kw)
    assert loaders.load_model(ckpt, **kw).load_stats.offload_bytes_written == 0
    key = "model.layers.3.mlp.down_proj.weight"
    _edit_shard(ckpt, _shard_of(ckpt, key), lambda t: {**t, key: t[key] * 2})  # re-saved: new weights, new mtime
    model = loaders.load_model(ckpt, **kw)
    assert model.load_stats.offload_bytes_written > 0
    w = model.model.layers[3].mlp.down_proj.weight
    assert torch.equal(w, (load_file(_shard_of(ckpt, key))[key]).to(torch.bfloat16))


def test_offload_folder_with_foreign_index_is_refused(tiny_llama, tmp_path):
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / INDEX).write_text(json.dumps({"some": "other tool"}))
    with pytest.raises(CheckpointError, match="not written by loadmaster"):
        loaders.load_model(
            tiny_llama, device_map=BF16_DISK, dtype="bfloat16", offload_folder=folder, show_progress=False
        )


def test_missing_tokenizer(ckpt):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (ckpt / name).unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="No usable tokenizer"):
        loaders.load_model_and_tokenizer(ckpt, device_map={"": "cpu"}, show_progress=False)


def test_default_offload_folder_is_per_model(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LOADMASTER_OFFLOAD_DIR", str(tmp_path / "cache"))
    model = loaders.load_model(tiny_llama, device_map=BF16_DISK, dtype="bfloat16", show_progress=False)
    folders = list((tmp_path / "cache").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("tiny-llama-")
    assert (folders[0] / INDEX).is_file() and model.load_stats.offload_bytes_written > 0
