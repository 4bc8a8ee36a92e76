"""The safetensors header reader against real files: ones written by the safetensors library, and corrupt ones."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from planner.errors import HeaderError, ModelSourceError
from planner.model.safetensors_header import INDEX_NAME, find_weight_files, read_checkpoint_headers, read_header
from tests.sparse_checkpoint import encode_header, write_sparse_checkpoint


def _raw_file(path: Path, header: bytes | str, data_len: int = 0, length: int | None = None) -> Path:
    """A file with an explicit length prefix, header bytes and a zero data region."""
    raw = header.encode() if isinstance(header, str) else header
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + b"\0" * data_len)
    return path


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---------------------------------------------------------------------------------------------- valid files


def test_reads_file_written_by_safetensors_library(tmp_path):
    tensors = {
        "a.weight": torch.zeros(3, 5, dtype=torch.float32),
        "b.bias": torch.zeros(7, dtype=torch.bfloat16),
        "c.idx": torch.zeros(2, 2, dtype=torch.int64),
        "d.half": torch.zeros(4, 1, dtype=torch.float16),
        "e.mask": torch.zeros(3, dtype=torch.bool),
        "f.fp8": torch.zeros(8, dtype=torch.float8_e4m3fn),
        "g.empty": torch.zeros(0, 4, dtype=torch.float32),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    h = read_header(path)
    assert h.metadata == {"format": "pt", "note": "x"}
    assert set(h.tensors) == set(tensors)
    with safe_open(str(path), "pt") as f:
        for name, t in tensors.items():
            e = h.tensors[name]
            assert e.dtype == str(t.dtype).replace("torch.", "")
            assert e.shape == tuple(t.shape)
            assert e.nbytes == t.numel() * t.element_size()
            assert tuple(f.get_slice(name).get_shape()) == e.shape
            # the absolute offset points at the real bytes: compare with what the library reads
    payload = {n: torch.arange(t.numel()).reshape(t.shape).to(t.dtype) if t.numel() else t for n, t in tensors.items()}
    save_file(payload, str(path))
    h = read_header(path)
    data = path.read_bytes()
    for name in ("a.weight", "c.idx"):
        e = h.tensors[name]
        got = torch.frombuffer(bytearray(data[e.offset : e.offset + e.nbytes]), dtype=payload[name].dtype)
        assert torch.equal(got.reshape(e.shape), payload[name])


def test_sparse_checkpoint_is_valid_for_the_reference_reader(tmp_path):
    spec = {"x.weight": ("bfloat16", (64, 32)), "y.weight": ("float32", (10,)), "z": ("int64", (3, 3))}
    paths = write_sparse_checkpoint(tmp_path, spec, shards=2)
    assert len(paths) == 2 and (tmp_path / INDEX_NAME).is_file()
    ck = read_checkpoint_headers(tmp_path)
    assert {n: (t.dtype, t.shape) for n, t in ck.tensors.items()} == spec
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == ck.nbytes == 64 * 32 * 2 + 40 + 72
    for p in paths:
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                assert str(t.dtype).replace("torch.", "") == spec[k][0] and tuple(t.shape) == spec[k][1]
                assert not t.any()


def test_large_sparse_checkpoint_takes_little_disk(tmp_path):
    write_sparse_checkpoint(tmp_path, {f"w{i}": ("bfloat16", (8192, 8192)) for i in range(8)}, shards=4)
    ck = read_checkpoint_headers(tmp_path)
    assert ck.nbytes == 8 * 8192 * 8192 * 2
    assert len(ck.files) == 4 and all(len(h.tensors) == 2 for h in ck.files)
    on_disk = sum(os.stat(p).st_blocks * 512 for p in tmp_path.glob("*.safetensors"))
    assert on_disk < 10 * 2**20  # the data region is a hole


# ---------------------------------------------------------------------------------------------- corrupt files


def test_file_shorter_than_length_prefix(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x05\x00\x00")
    with pytest.raises(HeaderError, match=r"short\.safetensors.*shorter than the 8-byte"):
        read_header(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    with pytest.raises(HeaderError, match="0 bytes"):
        read_header(p)


def test_absurd_header_length(tmp_path):
    p = _raw_file(tmp_path / "huge.safetensors", "{}", length=2**62)
    with pytest.raises(HeaderError, match="not a plausible header size"):
        read_header(p)


def test_header_length_past_end_of_file(tmp_path):
    p = _raw_file(tmp_path / "trunc.safetensors", '{"a": 1}', length=4096)
    with pytest.raises(HeaderError, match=r"trunc\.safetensors.*4096 bytes but the file has only"):
        read_header(p)


def test_truncated_real_file(tmp_path):
    p = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(100, 100)}, str(p))
    full = p.read_bytes()
    p.write_bytes(full[:40])  # cut inside the JSON
    with pytest.raises(HeaderError, match="file has only"):
        read_header(p)
    p.write_bytes(full[:-100])  # cut inside the data
    with pytest.raises(HeaderError, match="ends at data byte 40000 but the data region has only 39900"):
        read_header(p)


def test_bad_json(tmp_path):
    p = _raw_file(tmp_path / "bad.safetensors", '{"w": {"dtype": "F32", ')
    with pytest.raises(HeaderError, match=r"bad\.safetensors.*not valid JSON"):
        read_header(p)


def test_not_utf8(tmp_path):
    p = _raw_file(tmp_path / "bin.safetensors", b"\xff\xfe{}")
    with pytest.raises(HeaderError, match="not valid JSON"):
        read_header(p)


def test_json_not_an_object(tmp_path):
    p = _raw_file(tmp_path / "list.safetensors", "[1, 2, 3]")
    with pytest.raises(HeaderError, match="JSON list, expected an object"):
        read_header(p)


def test_unknown_dtype(tmp_path):
    p = _raw_file(tmp_path / "dt.safetensors", json.dumps({"w": _entry("F17", [2], 0, 8)}), data_len=8)
    with pytest.raises(HeaderError, match=r"'w' has unknown dtype 'F17'"):
        read_header(p)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}, "non-negative integers"),
        ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, r"expected \[begin, end\]"),
        ({"dtype": "F32", "shape": [2]}, r"expected \[begin, end\]"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "not a valid span"),
        ("not an entry", "is not an object"),
    ],
)
def test_malformed_entries(tmp_path, entry, message):
    p = _raw_file(tmp_path / "m.safetensors", json.dumps({"w": entry}), data_len=8)
    with pytest.raises(HeaderError, match=message):
        read_header(p)


def test_offsets_outside_the_file(tmp_path):
    p = _raw_file(tmp_path / "out.safetensors", json.dumps({"w": _entry("F32", [4], 0, 16)}), data_len=8)
    with pytest.raises(HeaderError, match=r"out\.safetensors.*'w' ends at data byte 16 but the data region has only 8"):
        read_header(p)


def test_offsets_inconsistent_with_shape(tmp_path):
    p = _raw_file(tmp_path / "sz.safetensors", json.dumps({"w": _entry("BF16", [4], 0, 16)}), data_len=16)
    with pytest.raises(HeaderError, match=r"spans 16 bytes but shape \[4\] of bfloat16 needs 8"):
        read_header(p)


def test_overlapping_tensors(tmp_path):
    doc = {"a": _entry("F32", [4], 0, 16), "b": _entry("F32", [4], 8, 24)}
    p = _raw_file(tmp_path / "ov.safetensors", json.dumps(doc), data_len=24)
    with pytest.raises(HeaderError, match="'a' and 'b' overlap"):
        read_header(p)


def test_adjacent_and_empty_tensors_do_not_overlap(tmp_path):
    doc = {"a": _entry("F32", [4], 0, 16), "e": _entry("F32", [0], 8, 8), "b": _entry("F32", [2], 16, 24)}
    p = _raw_file(tmp_path / "ok.safetensors", json.dumps(doc), data_len=24)
    assert set(read_header(p).tensors) == {"a", "e", "b"}


def test_metadata_must_be_an_object(tmp_path):
    p = _raw_file(tmp_path / "md.safetensors", json.dumps({"__metadata__": [1]}))
    with pytest.raises(HeaderError, match="__metadata__"):
        read_header(p)


def test_header_error_is_a_model_source_error_with_stable_type(tmp_path):
    p = _raw_file(tmp_path / "x.safetensors", "nope")
    with pytest.raises(ModelSourceError) as ei:
        read_header(p)
    assert ei.value.error_type == "plan" and "Re-download" in str(ei.value)


# ---------------------------------------------------------------------------------------------- directories


def test_index_naming_a_missing_shard(tmp_path):
    write_sparse_checkpoint(tmp_path, {"a": ("float32", (4,)), "b": ("float32", (4,))}, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelSourceError, match=r"missing.*model-00002-of-00002\.safetensors") as ei:
        read_checkpoint_headers(tmp_path)
    assert not isinstance(ei.value, HeaderError)


def test_index_disagreeing_with_shards(tmp_path):
    write_sparse_checkpoint(tmp_path, {"a": ("float32", (4,)), "b": ("float32", (4,))}, shards=2)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ModelSourceError, match="'ghost'.*no shard holds it"):
        read_checkpoint_headers(tmp_path)


def test_index_without_weight_map(tmp_path):
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelSourceError, match="weight_map"):
        read_checkpoint_headers(tmp_path)


def test_tensor_in_two_shards(tmp_path):
    for name in ("one.safetensors", "two.safetensors"):
        head, n = encode_header({"w": ("float32", (2,))})
        (tmp_path / name).write_bytes(head + b"\0" * n)
    with pytest.raises(ModelSourceError, match="'w' is stored in both one.safetensors and two.safetensors"):
        read_checkpoint_headers(tmp_path)


def test_directory_preference_and_glob(tmp_path):
    write_sparse_checkpoint(tmp_path / "single", {"a": ("float16", (3,))}, shards=1)
    files, wm = find_weight_files(tmp_path / "single")
    assert [f.name for f in files] == ["model.safetensors"] and wm == {}
    g = tmp_path / "glob"
    g.mkdir()
    for name in ("b.safetensors", "a.safetensors"):
        head, n = encode_header({name[0]: ("float32", (1,))})
        (g / name).write_bytes(head + b"\0" * n)
    ck = read_checkpoint_headers(g)
    assert [h.path.name for h in ck.files] == ["a.safetensors", "b.safetensors"]
    assert ck.weight_map == {"a": "a.safetensors", "b": "b.safetensors"}


def test_directory_without_safetensors_refuses_pickles(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelSourceError, match=r"no safetensors weights.*pytorch_model\.bin.*refuses"):
        read_checkpoint_headers(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ModelSourceError, match="expected model.safetensors.index.json") as ei:
        read_checkpoint_headers(tmp_path)
    assert "pickle" not in str(ei.value)


def test_corrupt_shard_names_the_file(tmp_path):
    write_sparse_checkpoint(tmp_path, {"a": ("float32", (4,)), "b": ("float32", (4,))}, shards=2)
    p = tmp_path / "model-00002-of-00002.safetensors"
    os.truncate(p, p.stat().st_size - 4)
    with pytest.raises(HeaderError, match=r"model-00002-of-00002\.safetensors.*truncated"):
        read_checkpoint_headers(tmp_path)
