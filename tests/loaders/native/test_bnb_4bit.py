"""Our torch decoding of bitsandbytes 4-bit layers against bitsandbytes' own reference decoding
(:func:`bench.quant_checkpoints.bnb_4bit_dequantized`: ``dequantize_4bit``'s steps on its torch implementation, since
its AVX-512 CPU kernel decodes some shapes wrongly).

Each layer is quantized by bitsandbytes' ``quantize_4bit``, saved under ``Linear4bit``'s keys through safetensors
and read back, then decoded twice: by :func:`loaders.native.bnb_4bit.dequantize_bnb_4bit` from the stored tensors,
and by bitsandbytes from the ``QuantState`` its ``from_dict`` rebuilds out of the same tensors. Both compute one
float32 product a weight, so they must agree bit for bit: nf4 and fp4, with and without double quant, block sizes
32 to 128, and weights whose count is not a whole number of blocks (or of bytes).

The native kernel (``loadmaster::linear_nf4``) on every path this CPU runs, and torch's: products against the
float64 product of bitsandbytes' dequantized weight, within float32 summation error (float32 x) or one bfloat16
rounding of the output (bfloat16 x); each of the 16 codes at every position of a block; a row's result
independent of its batch."""

from __future__ import annotations

import pytest
import torch
from bitsandbytes.functional import QuantState
from safetensors.torch import load_file, save_file

from bench.quant_checkpoints import bnb_4bit_dequantized, bnb_4bit_tensors
from loaders.errors import CheckpointError
from loaders.native import operators
from loaders.native.bnb_4bit import Bnb4CPULinear, dequantize_bnb_4bit, read_quant_state
from loaders.native.packed_formats import PackedStats, repack
from planner.model.packed_linear import PackedLinear
from planner.model.quant_config import quant_format


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
    want = bnb_4bit_dequantized(stored["weight"], state)
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


def _kernel_layer(quant_type: str, n: int, k: int, blocksize: int = 64, double_quant: bool = False, seed: int = 0):
    """A :class:`Bnb4CPULinear` of random weights quantized by bitsandbytes, and bitsandbytes' dequantized weight."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    stored, want = bnb_4bit_tensors(w, quant_type, double_quant, blocksize)
    layer = Bnb4CPULinear.from_packed(_stored_layer(stored, quant_type, n, k), "q_proj")
    assert layer is not None
    return layer, want


def _within_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """``out`` within float32 summation error of the float64 product (float32 x); with bfloat16 x, within the
    bfloat16 roundings of the output and (torch's path, on a bfloat16 dequantized weight) of each weight."""
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ w.double().abs().t()).max().item() + 1e-30
    tol = 1e-5 * scale if x.dtype is torch.float32 else 2**-7 * scale
    return (out.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "blocksize"), [(1, 40, 128, 64), (3, 9, 96, 32), (5, 257, 512, 128), (32, 33, 64, 64)]
)
def test_kernel_matches_bitsandbytes_dequantized(kernel_path, quant_type, dtype, m, n, k, blocksize):
    layer, w = _kernel_layer(quant_type, n, k, blocksize, double_quant=m == 3, seed=m * n)
    assert torch.equal(layer.dequantized_weight(torch.float32), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if m != 1 else None
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (m, n)
    assert _within_rounding(out, x, w, bias)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_every_code_comes_out_exactly(kernel_path, quant_type):
    """Each code at each position of a 64-input block, x one-hot: the output is table[code] * absmax exactly."""
    layer, w = _kernel_layer(quant_type, 16, 128)
    codes = torch.arange(16, dtype=torch.uint8)
    layer.codes = ((codes[:, None] << 4) | codes.flip(0)[:, None]).expand(16, 64).contiguous()
    w = layer.dequantized_weight(torch.float32)
    for j in (0, 1, 14, 15, 62, 63, 64, 127):
        x = torch.zeros(1, 128)
        x[0, j] = 1.0
        assert torch.equal(layer(x)[0], w[:, j]), j


def test_rows_do_not_depend_on_their_batch(native_path):
    layer, _ = _kernel_layer("nf4", 70, 256)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    together = layer(x)
    for i in range(7):
        assert torch.equal(layer(x[i : i + 1])[0], together[i])


def test_prompts_and_long_products_run_torch_on_dequantized_tiles(kernel_path):
    layer, w = _kernel_layer("fp4", 48, 192, double_quant=True)
    for x in (torch.randn(1, 40, 192).to(torch.bfloat16), torch.randn(40, 192)):  # a bf16 prompt; beyond 32 rows
        out = layer(x)
        want = torch.nn.functional.linear(x, w.to(x.dtype))
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5 if x.dtype is torch.float32 else 2e-2)


def test_blocks_that_straddle_rows_and_gpu_layers_are_dequantized_at_load():
    """in_features 96 in blocks of 64: no kernel layout, so the layer is dequantized, as every layer off the CPU."""
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(5))
    stored, want = bnb_4bit_tensors(w, "nf4", True, 64)
    layer, kind = repack(_stored_layer(stored, "nf4", 8, 96), torch.bfloat16, PackedStats(), True, "q_proj")
    assert kind == "nf4 -> bfloat16" and torch.equal(layer.weight, want.to(torch.bfloat16))
    stored, want = bnb_4bit_tensors(w[:, :64], "fp4", False, 64)
    layer, kind = repack(_stored_layer(stored, "fp4", 8, 64), torch.float32, PackedStats(), False, "q_proj")
    assert kind == "fp4 -> float32" and torch.equal(layer.weight, want)


def test_the_operator_checks_operands_and_has_fake_shapes():
    layer, _ = _kernel_layer("nf4", 8, 64)
    with pytest.raises(ValueError, match="x has 32 features, the codes 64"):
        operators.linear_nf4(torch.randn(1, 32), layer.codes, layer.absmax, layer.table, None)
    with pytest.raises(ValueError, match="absmax must be float32"):
        operators.linear_nf4(torch.randn(1, 64), layer.codes, layer.absmax.double(), layer.table, None)
    with pytest.raises(ValueError, match="table must be 16"):
        operators.linear_nf4(torch.randn(1, 64), layer.codes, layer.absmax, layer.table[:8], None)
    meta = operators.linear_nf4(
        torch.empty(2, 3, 64, device="meta"),
        layer.codes.to("meta"),
        layer.absmax.to("meta"),
        layer.table.to("meta"),
        None,
    )
    assert meta.shape == (2, 3, 8)


@pytest.mark.parametrize(("blocksize", "k"), [(16, 64), (48, 192), (64, 320), (96, 192)])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_blocks_of_any_multiple_of_16_inputs(native_path, blocksize, k, m):
    """Blocks of an odd number of 16-input chunks (16, 48: the kernel's half step) and of 64 (the kernel's
    specialized block), on one and on several rows, against the dequantized weight in float64."""
    g = torch.Generator().manual_seed(blocksize + k + m)
    n = 37
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    absmax = torch.rand(n, k // blocksize, generator=g) + 0.1
    table = torch.sort(torch.randn(16, generator=g)).values
    x = torch.randn(m, k, generator=g)
    out = operators.linear_nf4(x, codes, absmax, table, None)
    w = operators.dequantize_nf4(codes, absmax, table, torch.float32)
    assert _within_rounding(out, x, w, None)
    assert torch.equal(operators.linear_nf4(x[-1:], codes, absmax, table, None)[0], out[-1])
