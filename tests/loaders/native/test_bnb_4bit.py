"""Our torch decoding of bitsandbytes 4-bit layers against bitsandbytes' own ``dequantize_4bit`` (its CPU backend).

Each layer is quantized by bitsandbytes' ``quantize_4bit``, saved under ``Linear4bit``'s keys through safetensors
and read back, then decoded twice: by :func:`loaders.native.bnb_4bit.dequantize_bnb_4bit` from the stored tensors,
and by bitsandbytes from the ``QuantState`` its ``from_dict`` rebuilds out of the same tensors. Both compute one
float32 product a weight, so they must agree bit for bit: nf4 and fp4, with and without double quant, block sizes
32 to 256, and weights whose count is not a whole number of blocks (or of bytes)."""

from __future__ import annotations

import pytest
import torch
from bitsandbytes.functional import QuantState, dequantize_4bit
from safetensors.torch import load_file, save_file

from loaders.errors import CheckpointError
from loaders.native.bnb_4bit import dequantize_bnb_4bit, read_quant_state
from planner.model.packed_linear import PackedLinear
from planner.model.quant_config import quant_format
from tests.quant_checkpoints import bnb_4bit_tensors


def _stored_layer(tensors: dict[str, torch.Tensor], quant_type: str, n: int, k: int) -> PackedLinear:
    """A stored layer holding ``tensors`` (suffix -> tensor), as the loader fills one from the shards."""
    cfg = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": quant_type}
    fmt = quant_format({"quantization_config": cfg})
    assert fmt is not None
    layer = PackedLinear(fmt, k, n, {s: (tuple(t.shape), t.dtype) for s, t in tensors.items()}, None)
    for suffix, t in tensors.items():
        layer._buffers[suffix] = t
    return layer


def _saved_and_read(tensors: dict[str, torch.Tensor], tmp_path) -> dict[str, torch.Tensor]:
    path = tmp_path / "layer.safetensors"
    save_file({f"q_proj.{s}": t.contiguous() for s, t in tensors.items()}, path)
    return {key.removeprefix("q_proj."): t for key, t in load_file(path).items()}


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize(("n", "k", "blocksize"), [(96, 160, 64), (7, 51, 64), (33, 96, 128), (300, 130, 32)])
def test_decodes_as_bitsandbytes_does_bit_for_bit(quant_type, double_quant, n, k, blocksize, tmp_path):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.05
    stored, _ = bnb_4bit_tensors(w, quant_type, double_quant, blocksize)
    stored = _saved_and_read(stored, tmp_path)
    assert set(stored) >= {
        "weight",
        "weight.absmax",
        "weight.quant_map",
        f"weight.quant_state.bitsandbytes__{quant_type}",
    }
    assert ("weight.nested_absmax" in stored) == double_quant
    state = QuantState.from_dict({s.removeprefix("weight."): t for s, t in stored.items() if s != "weight"}, "cpu")
    want = dequantize_4bit(stored["weight"], state).float()
    got = dequantize_bnb_4bit(_stored_layer(stored, quant_type, n, k), "q_proj")
    assert got.shape == (n, k) and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_a_quant_state_for_another_shape_is_refused_by_name(tmp_path):
    stored, _ = bnb_4bit_tensors(torch.randn(16, 64), "nf4", False)
    other, _ = bnb_4bit_tensors(torch.randn(64, 16), "nf4", False)
    stored["weight.quant_state.bitsandbytes__nf4"] = other["weight.quant_state.bitsandbytes__nf4"]
    with pytest.raises(CheckpointError, match=r"layers\.3\.q_proj: the quant state says .*shape=\[64, 16\]"):
        dequantize_bnb_4bit(_stored_layer(stored, "nf4", 16, 64), "layers.3.q_proj")


def test_a_quant_state_that_is_not_json_is_refused_by_name():
    blob = torch.tensor(list(b"\x00not json"), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="q_proj.weight.quant_state.bitsandbytes__nf4: not a bitsandbytes"):
        read_quant_state(blob, "q_proj.weight.quant_state.bitsandbytes__nf4")
