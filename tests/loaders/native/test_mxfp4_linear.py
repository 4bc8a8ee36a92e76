"""The MXFP4 kernel (``kernels/linear_mxfp4.c`` through :class:`loaders.native.mxfp4_linear.Mxfp4CPULinear`) against
transformers' own MXFP4 dequantizer, on every instruction-set path this CPU runs and on torch's.

Tolerance: the kernel rounds each 64-input group of x to int8 (as our int4 kernel does) and sums the codes exactly
in integers, so it differs from the float64 product of the dequantized weight by at most the activation rounding
bound (half a step of each group times ``sum |W|`` over the group) plus float32 summation (1e-5 of ``|x| @ |W|``);
in bfloat16 also by the output's rounding (2^-8). torch's path (dequantized weight, torch's GEMM) has no activation
rounding: its bound is zero.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from bench.quant_checkpoints import mxfp4_quantize, mxfp4_reference
from loaders.native import operators
from loaders.native.mxfp4_linear import Mxfp4CPULinear

GROUP = operators.GROUP


def _layer(n: int, k: int, seed: int, dtype: torch.dtype = torch.float32, bias: bool = True) -> Mxfp4CPULinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.001, 2, n)[:, None]  # scales across many exponents
    blocks, scales = mxfp4_quantize(w)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return Mxfp4CPULinear(k, n, blocks, scales, b)


def _activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|kernel - x @ w^T| from rounding x to int8 per group of 64 (see the module docstring)."""
    m, k = x.shape
    g = math.ceil(k / GROUP)
    xp = F.pad(x.double(), (0, g * GROUP - k)).view(m, g, GROUP)
    half_step = xp.abs().amax(dim=2) / 127 / 2
    wp = F.pad(w.double().abs(), (0, g * GROUP - k)).view(-1, g, GROUP).sum(dim=2)
    return half_step @ wp.T


def _close(out: torch.Tensor, x: torch.Tensor, layer: Mxfp4CPULinear, native: bool) -> bool:
    w = mxfp4_reference(layer.blocks, layer.scales).double()
    ref = x.double() @ w.T + (layer.bias.double() if layer.bias is not None else 0)
    bound = _activation_bound(x, w) if native else torch.zeros_like(ref)
    rel = 2**-8 if out.dtype == torch.bfloat16 else 1e-5
    tol = (x.double().abs() @ w.abs().T) * rel + ref.abs() * rel + 1e-6
    return bool(((out.double() - ref).abs() <= bound + tol).all())


def test_dequantization_equals_transformers_for_every_byte():
    """Every byte (both nibbles: all 16 codes, -0 included) under scales 2^-20 .. 2^20: torch's dequantization (the
    prompts' path and the reference of the load tests) gives transformers' ``convert_moe_packed_tensors`` exactly."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 1, 16).repeat(1, 3, 1)  # [16 rows, 3 blocks, 16]
    scales = torch.tensor([[107, 127, 147]], dtype=torch.uint8).repeat(16, 1)
    want = mxfp4_reference(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16):
        got = operators.dequantize_mxfp4(blocks, scales, dtype)
        assert torch.equal(got.float(), want), dtype
    assert torch.equal(operators.dequantize_mxfp4(blocks, scales, torch.float32, (5, 9)), want[5:9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_comes_out_exactly(kernel_path, dtype):
    """One-hot rows of x pick single weights: each of the 16 codes (low and high nibble, every place in a block)
    times its scale, exactly (a one-hot group rounds to int8 exactly)."""
    n, k = 16, 96  # three blocks: a run of two and one alone on AVX2, a partial run on AVX-512
    blocks = torch.zeros(n, k // 32, 16, dtype=torch.uint8)
    for c in range(16):
        blocks[c] = c | (((c + 5) % 16) << 4)
    scales = torch.tensor([126, 127, 131], dtype=torch.uint8).repeat(n, 1)
    layer = Mxfp4CPULinear(k, n, blocks, scales, None)
    want = mxfp4_reference(blocks, scales).to(dtype)
    for i in (0, 1, 30, 31, 32, 47, 64, 95):
        x = torch.zeros(1, k, dtype=dtype)
        x[0, i] = 1.0
        with torch.no_grad():
            assert torch.equal(layer(x)[0], want[:, i]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k", [(1, 64, 64), (3, 37, 96), (1, 130, 4096 + 32), (5, 257, 288), (32, 20, 224), (2, 9, 32)]
)
def test_kernel_matches_transformers_dequantized(kernel_path, dtype, m, n, k):
    layer = _layer(n, k, seed=m * 7 + n + k, dtype=dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    with torch.no_grad():
        out = layer(x)
    assert out.dtype == dtype and out.shape == (m, n)
    assert _close(out, x, layer, kernel_path.available)


def test_rows_do_not_depend_on_their_batch(native_path):
    layer = _layer(70, 320, seed=3, dtype=torch.bfloat16)
    x = torch.randn(32, 320).to(torch.bfloat16)
    with torch.no_grad():
        together = layer(x)
        for i in (0, 5, 30, 31):
            assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
            assert torch.equal(layer(x[i : i + 3]), together[i : i + 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_and_long_products_run_torch_on_dequantized_tiles(kernel_path, monkeypatch, dtype):
    layer = _layer(300, 96, seed=5, dtype=dtype)
    x = torch.randn(2, 40, 96).to(dtype)  # 80 rows: beyond the kernel's 32, and a bf16 prompt
    want = F.linear(x, layer.dequantized_weight(dtype), layer.bias)
    monkeypatch.setattr(operators, "TILE_BYTES", 4 * 96 * 128)  # tiles of 128 output rows: 3 of them
    with torch.no_grad():
        got = layer(x)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_the_operator_checks_operands_and_has_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layer(12, 96, seed=1, bias=False)
    b, s = layer.blocks, layer.scales
    with pytest.raises(ValueError, match="x has 95 features, the blocks 96"):
        operators.linear_mxfp4(torch.randn(1, 95), b, s, None)
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[N, K/32, 16\]"):
        operators.linear_mxfp4(torch.randn(1, 96), b.reshape(12, -1), s, None)
    with pytest.raises(ValueError, match=r"scales must be uint8 \[12, 3\]"):
        operators.linear_mxfp4(torch.randn(1, 96), b, s.float(), None)
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        Mxfp4CPULinear(100, 12, b, s, None)
    with FakeTensorMode() as mode:
        out = operators.linear_mxfp4(
            mode.from_tensor(torch.randn(2, 3, 96).to(torch.bfloat16)), mode.from_tensor(b), mode.from_tensor(s), None
        )
    assert tuple(out.shape) == (2, 3, 12) and out.dtype == torch.bfloat16
