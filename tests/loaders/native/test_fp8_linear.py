"""The FP8 e4m3 kernel (``kernels/linear_fp8.c`` through :class:`loaders.native.fp8_linear.Fp8CPULinear`) against
plain torch's ``float8_e4m3fn`` dequantization, on every instruction-set path this CPU runs and on torch's.

Tolerance: the kernel sums float32 products of exactly converted weights, so it differs from the float64 product of
the dequantized weight by float32 summation (1e-5 of ``|x| @ |W|``); in bfloat16 also by the output's rounding (2^-8).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from loaders.native import operators
from loaders.native.fp8_linear import Fp8CPULinear

#: (rows, block) of the scale grids checkpoints ship: per output channel, per tensor, 128x128 blocks, and a
#: compressed-tensors group of 64 inputs.
GRIDS = {"channel": None, "tensor": None, "block128": (128, 128), "group64": (1, 64)}


def _layer(n: int, k: int, grid: str, seed: int, dtype: torch.dtype = torch.float32) -> Fp8CPULinear:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)  # spans normals and subnormals
    if grid == "channel":
        block, shape = (1, k), (n, 1)
    elif grid == "tensor":
        block, shape = (n, k), (1, 1)
    else:
        block = GRIDS[grid]
        shape = (-(-n // block[0]), -(-k // block[1]))
    scales = torch.rand(shape, generator=g) * 0.01 + 0.001
    return Fp8CPULinear(k, n, weight, scales, block, torch.randn(n, generator=g).to(dtype))


def _reference(layer: Fp8CPULinear, x: torch.Tensor) -> torch.Tensor:
    """Plain torch: the e4m3 codes as float32 times their scale, in float64."""
    n, k = layer.weight.shape
    s = layer.scales.repeat_interleave(layer.block_rows, 0)[:n].repeat_interleave(layer.block_cols, 1)[:, :k]
    w = layer.weight.to(torch.float32).double() * s.double()
    out = x.double() @ w.T
    return out + layer.bias.double() if layer.bias is not None else out


def _close(out: torch.Tensor, x: torch.Tensor, layer: Fp8CPULinear) -> bool:
    ref = _reference(layer, x)
    w = layer.dequantized_weight(torch.float64)
    rel = 2**-8 if out.dtype == torch.bfloat16 else 1e-5
    tol = (x.double().abs() @ w.abs().T) * rel + ref.abs() * rel + 1e-6
    return bool(((out.double() - ref).abs() <= tol).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_finite_code_converts_exactly(kernel_path, dtype):
    """Each of the 254 finite e4m3fn codes (0x7F and 0xFF are NaN, never written by quantizers) times one-hot rows
    of x gives the code's value exactly: normals, subnormals, both zeros (each is exactly a bfloat16 too, so bf16
    x, which AVX-512 CPUs with VBMI multiply through byte tables, gives them exactly as well)."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    k = 70  # one row's tail spans a partial vector on every path
    weight = torch.zeros(len(codes), k, dtype=torch.uint8)
    weight[:, 3] = codes
    weight[:, 66] = codes.flip(0)
    layer = Fp8CPULinear(k, len(codes), weight.view(torch.float8_e4m3fn), torch.ones(len(codes), 1), (1, k), None)
    x = torch.zeros(2, k)
    x[0, 3] = 1.0
    x[1, 66] = 1.0
    with torch.no_grad():
        out = layer(x.to(dtype))
    want = weight.view(torch.float8_e4m3fn).to(torch.float32).to(dtype)
    assert torch.equal(want.to(torch.float32), weight.view(torch.float8_e4m3fn).to(torch.float32))
    assert torch.equal(out[0], want[:, 3]) and torch.equal(out[1], want[:, 66])


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 37, 100), (1, 130, 4096 + 7), (5, 257, 300), (32, 20, 200)])
def test_kernel_matches_torch_float8_dequantized(kernel_path, grid, dtype, m, n, k):
    layer = _layer(n, k, grid, seed=m * 7 + n + k, dtype=dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    with torch.no_grad():
        out = layer(x)
    assert out.dtype == dtype and out.shape == (m, n)
    assert _close(out, x, layer)


def test_rows_do_not_depend_on_their_batch(native_path):
    layer = _layer(70, 300, "block128", seed=3, dtype=torch.bfloat16)
    x = torch.randn(32, 300).to(torch.bfloat16)
    with torch.no_grad():
        together = layer(x)
        for i in (0, 5, 30, 31):
            assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
            assert torch.equal(layer(x[i : i + 3]), together[i : i + 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_and_long_products_run_torch_on_dequantized_tiles(kernel_path, monkeypatch, dtype):
    layer = _layer(300, 96, "block128", seed=5, dtype=dtype)
    x = torch.randn(2, 40, 96).to(dtype)  # 80 rows: beyond the kernel's 32, and a bf16 prompt
    want = F.linear(x, layer.dequantized_weight(dtype), layer.bias)
    monkeypatch.setattr(operators, "TILE_BYTES", 4 * 96 * 128)  # tiles of 128 output rows: 3 of them
    with torch.no_grad():
        got = layer(x)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_tiles_equal_torch_float8_conversion(kernel_path, grid, dtype):
    """What prompts multiply: the native conversion (or torch's, on the torch path) gives torch's values exactly,
    ``(code.float() * scale).to(dtype)``, for any run of rows."""
    layer = _layer(261, 4096 + 40, grid, seed=9)
    n, k = layer.weight.shape
    s = layer.scales.repeat_interleave(layer.block_rows, 0)[:n].repeat_interleave(layer.block_cols, 1)[:, :k]
    want = (layer.weight.to(torch.float32) * s).to(dtype)
    for rows in ((0, n), (0, 1), (127, 131), (250, 261)):
        got = operators.dequantize_fp8(layer.weight, layer.scales, layer.block_rows, layer.block_cols, dtype, rows)
        assert torch.equal(got, want[rows[0] : rows[1]]), rows


def test_the_operator_checks_operands_and_has_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layer(12, 100, "block128", seed=1)
    w, s = layer.weight, layer.scales
    with pytest.raises(ValueError, match="x has 99 features, the weight 100"):
        operators.linear_fp8(torch.randn(1, 99), w, s, None, 128, 128)
    with pytest.raises(ValueError, match="scales must be contiguous float32"):
        operators.linear_fp8(torch.randn(1, 100), w, s.double(), None, 128, 128)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        operators.linear_fp8(torch.randn(1, 100), w.view(torch.uint8), s, None, 128, 128)
    with pytest.raises(ValueError, match="a multiple of 64"):
        operators.linear_fp8(torch.randn(1, 100), w, torch.ones(1, 4), None, 128, 30)
    with FakeTensorMode() as mode:
        out = operators.linear_fp8(
            mode.from_tensor(torch.randn(2, 3, 100).to(torch.bfloat16)),
            mode.from_tensor(w),
            mode.from_tensor(s),
            None,
            128,
            128,
        )
    assert tuple(out.shape) == (2, 3, 12) and out.dtype == torch.bfloat16
