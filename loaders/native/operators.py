"""The native CPU kernels as torch operators: ``torch.ops.loadmaster.linear``, ``linear_multi``, ``linear_q8``,
``linear_q4``, ``linear_fp8``, ``linear_mxfp4``, ``linear_nf4`` and ``decode_attention``.

Why operators and not bare ctypes calls: registered with ``torch.library``, each has a schema (argument types are
checked by the dispatcher), a Meta implementation (shapes and dtypes propagate through the meta device and fake
tensors, which run it, so tracing and ``torch.compile`` see what comes out without running C), and one CPU
implementation that checks its operands and calls :mod:`loaders.native.kernel_build`. Each call passes
``torch.get_num_threads()``.

The CPU implementations fall back to torch's own kernels where the native library is not loaded (another CPU, no
compiler, ``LOADMASTER_CPU_ISA=torch``) and, for the quantized operators, for products with more rows than the
kernel takes (long prefills), where the weight is dequantized for that call and torch's GEMM runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch.nn import functional as F

from loaders.native import kernel_build
from loaders.native.kernel_build import KERNELS, QUANT_KERNELS
from planner.model.quant_config import MXFP4_BLOCK

GROUP = 64  # inputs per activation group and per 4-bit scale group; LM_GROUP in kernels/common.h
MULTI_MAX = 8  # products per linear_multi call; LM_MULTI_MAX in kernels/common.h

_lib = torch.library.Library("loadmaster", "DEF")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.define("linear_multi(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]")
_lib.define("linear_q8(Tensor x, Tensor qweight, Tensor scale, Tensor? bias, int in_features) -> Tensor")
_lib.define("linear_q4(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int in_features) -> Tensor")
_lib.define("linear_q4z(Tensor x, Tensor packed, Tensor scales, Tensor zeros, Tensor? bias, int in_features) -> Tensor")
_lib.define(
    "linear_fp8(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int block_rows, int block_cols) -> Tensor"
)
_lib.define("linear_mxfp4(Tensor x, Tensor blocks, Tensor scales, Tensor? bias) -> Tensor")
_lib.define("linear_nf4(Tensor x, Tensor codes, Tensor absmax, Tensor table, Tensor? bias) -> Tensor")
_lib.define("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")


_bound: dict[str, object] = {}


def _fn(name: str):
    """The bound kernel, or ``None`` where the native library is not loaded (the torch fallback runs).

    Looked up once per process and kernel: this runs for every linear layer at every decode step."""
    try:
        return _bound[name]
    except KeyError:
        fn = kernel_build.function(name) if kernel_build.status().available else None
        _bound[name] = fn
        return fn


kernel_build.on_reset(_bound.clear)  # a reset (tests, benches switching paths) rebinds on the next call


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _out_shape(x: torch.Tensor, n: int) -> list[int]:
    return [*x.shape[:-1], n]


# -- float kernels -----------------------------------------------------------------------------------------------
def _linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    dtype = weight.dtype
    kernel = KERNELS.get(dtype)
    if kernel is None:
        raise ValueError(f"loadmaster::linear takes bfloat16 or float32 weights, not {dtype}")
    if x.dtype is not dtype or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"loadmaster::linear: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {dtype}"
        )
    n, k = weight.shape
    fn = _fn(kernel.name)
    x2 = _rows(x, k)
    m = x2.shape[0]
    if fn is None or weight.stride(1) != 1 or not 0 < m <= kernel.max_rows or k == 0:
        return F.linear(x, weight, bias)
    out = torch.empty((m, n), dtype=dtype)
    bias_ptr = None
    if bias is not None:
        bias = bias.to(dtype).contiguous()
        bias_ptr = bias.data_ptr()
    rc = fn(
        x2.data_ptr(),
        x2.stride(0),
        weight.data_ptr(),
        weight.stride(0),
        bias_ptr,
        out.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"{kernel.symbol} rejected shapes x={tuple(x.shape)} weight={tuple(weight.shape)}")
    return out.view(_out_shape(x, n))


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    torch._check(x.shape[-1] == weight.shape[1], lambda: "loadmaster::linear: x and weight disagree on in_features")
    torch._check(x.dtype == weight.dtype, lambda: "loadmaster::linear: x and weight dtypes differ")
    return x.new_empty(_out_shape(x, weight.shape[0]))


def _linear_multi_cpu(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """Every ``x @ W_i^T (+ b_i)`` in one native call when the float kernel takes them all (the same dtype, x's
    features, contiguous rows); each result equals :func:`_linear_cpu`'s for that weight bit for bit. Otherwise one
    product at a time."""
    if len(weights) != len(biases) or not weights:
        raise ValueError(f"loadmaster::linear_multi: {len(weights)} weights but {len(biases)} biases")
    k = x.shape[-1]
    kernel = KERNELS.get(x.dtype)
    fn = _fn(kernel.multi) if kernel is not None else None
    x2 = _rows(x, k)
    m = x2.shape[0]
    native = (
        fn is not None
        and len(weights) <= MULTI_MAX
        and 0 < m <= kernel.max_rows
        and k > 0
        and all(w.dtype is x.dtype and w.dim() == 2 and w.shape[1] == k and w.stride(1) == 1 for w in weights)
    )
    if not native:
        return [_linear_cpu(x, w, b) for w, b in zip(weights, biases)]
    count = len(weights)
    outs = [torch.empty((m, w.shape[0]), dtype=x.dtype) for w in weights]
    kept = [None if b is None else b.to(x.dtype).contiguous() for b in biases]  # alive until the call returns
    pointers = ctypes.c_void_p * count
    rc = fn(
        x2.data_ptr(),
        x2.stride(0),
        count,
        pointers(*(w.data_ptr() for w in weights)),
        (ctypes.c_long * count)(*(w.stride(0) for w in weights)),
        pointers(*(None if b is None else b.data_ptr() for b in kept)),
        pointers(*(o.data_ptr() for o in outs)),
        (ctypes.c_long * count)(*(w.shape[0] for w in weights)),
        (ctypes.c_int * count)(*(w.shape[0] for w in weights)),
        m,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"lm_{kernel.multi} rejected x={tuple(x.shape)} and {count} weights")
    return [o.view(_out_shape(x, w.shape[0])) for o, w in zip(outs, weights)]


def _linear_multi_fake(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    return [_linear_fake(x, w, b) for w, b in zip(weights, biases)]


# -- quantized kernels -------------------------------------------------------------------------------------------
def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``[N, in_features]`` that int8 rows and per-channel scales stand for."""
    return (qweight[:, :in_features].to(torch.float32) * scale[:, None]).to(dtype)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``[N, in_features]`` that packed 4-bit groups and their float16 scales stand for."""
    n = packed.shape[0]
    p = packed.view(n, -1, GROUP // 2)
    q = torch.cat([p & 0x0F, p >> 4], dim=2).to(torch.float32) - 8.0  # [N, G, 64]
    w = q * scales.to(torch.float32)[:, :, None]
    return w.reshape(n, -1)[:, :in_features].to(dtype)


def dequantize_int4_zeros(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_int4` with a zero point per group (float16 ``[N, G]``) in place of the 8."""
    n = packed.shape[0]
    p = packed.view(n, -1, GROUP // 2)
    q = torch.cat([p & 0x0F, p >> 4], dim=2).to(torch.float32) - zeros.to(torch.float32)[:, :, None]
    w = q * scales.to(torch.float32)[:, :, None]
    return w.reshape(n, -1)[:, :in_features].to(dtype)


def _check_quant(
    op: str,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    in_features: int,
    row_bytes: int,
    qdtype: torch.dtype,
    sdtype: torch.dtype,
    scale_cols: int | None,
) -> None:
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        raise ValueError(f"loadmaster::{op} takes float32 or bfloat16 x, not {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"loadmaster::{op}: x has {x.shape[-1]} features, the layer {in_features}")
    if qweight.dtype is not qdtype or qweight.dim() != 2 or qweight.shape[1] < row_bytes or qweight.stride(1) != 1:
        raise ValueError(
            f"loadmaster::{op}: weight must be {qdtype} [N, >= {row_bytes}] with contiguous rows, "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )
    want_scale = (qweight.shape[0],) if scale_cols is None else (qweight.shape[0], scale_cols)
    if scale.dtype is not sdtype or tuple(scale.shape) != want_scale or not scale.is_contiguous():
        raise ValueError(
            f"loadmaster::{op}: scales must be contiguous {sdtype} {want_scale}, got {scale.dtype} {tuple(scale.shape)}"
        )


def _groups(in_features: int) -> int:
    return (in_features + GROUP - 1) // GROUP


#: Rows each quantized kernel takes, by symbol name (``linear_q4z`` is the 4-bit kernel's).
_QUANT_MAX_ROWS = {k.name: k.max_rows for k in QUANT_KERNELS.values()} | {"linear_q4z": QUANT_KERNELS["int4"].max_rows}


def _call_quant(name: str, x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int, args) -> torch.Tensor | None:
    """Run a quantized kernel, or return ``None`` for the torch fallback."""
    fn = _fn(name)
    x2 = _rows(x, k)
    m = x2.shape[0]
    if fn is None or not 0 < m <= _QUANT_MAX_ROWS[name]:
        return None
    out = torch.empty((m, n), dtype=x.dtype)
    bias_ptr = None
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
        bias_ptr = bias.data_ptr()
    rc = fn(
        x2.data_ptr(),
        x2.stride(0),
        int(x.dtype == torch.bfloat16),
        *args,
        bias_ptr,
        out.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"lm_{name} failed ({rc}) for x={tuple(x.shape)} and {n} outputs")
    return out.view(_out_shape(x, n))


def _linear_q8_cpu(x, qweight, scale, bias, in_features: int) -> torch.Tensor:
    _check_quant(
        "linear_q8", x, qweight, scale, in_features, _groups(in_features) * GROUP, torch.int8, torch.float32, None
    )
    n = qweight.shape[0]
    out = _call_quant("linear_q8", x, bias, n, in_features, (qweight.data_ptr(), qweight.stride(0), scale.data_ptr()))
    if out is None:
        out = F.linear(x, dequantize_int8(qweight, scale, in_features, x.dtype), bias)
    return out


def _linear_q4_cpu(x, packed, scales, bias, in_features: int) -> torch.Tensor:
    g = _groups(in_features)
    _check_quant("linear_q4", x, packed, scales, in_features, g * GROUP // 2, torch.uint8, torch.float16, g)
    n = packed.shape[0]
    out = _call_quant(
        "linear_q4", x, bias, n, in_features, (packed.data_ptr(), packed.stride(0), scales.data_ptr(), scales.stride(0))
    )
    if out is None:
        out = F.linear(x, dequantize_int4(packed, scales, in_features, x.dtype), bias)
    return out


def _linear_q4z_cpu(x, packed, scales, zeros, bias, in_features: int) -> torch.Tensor:
    g = _groups(in_features)
    _check_quant("linear_q4z", x, packed, scales, in_features, g * GROUP // 2, torch.uint8, torch.float16, g)
    if zeros.dtype is not torch.float16 or tuple(zeros.shape) != tuple(scales.shape) or not zeros.is_contiguous():
        raise ValueError(f"loadmaster::linear_q4z: zeros must be contiguous float16 {tuple(scales.shape)}")
    n = packed.shape[0]
    args = (packed.data_ptr(), packed.stride(0), scales.data_ptr(), scales.stride(0), zeros.data_ptr(), zeros.stride(0))
    out = _call_quant("linear_q4z", x, bias, n, in_features, args)
    if out is None:
        out = F.linear(x, dequantize_int4_zeros(packed, scales, zeros, in_features, x.dtype), bias)
    return out


def _quant_z_fake(x, packed, scales, zeros, bias, in_features: int) -> torch.Tensor:
    return _quant_fake(x, packed, scales, bias, in_features)


def _quant_fake(x, qweight, scale, bias, in_features: int) -> torch.Tensor:
    torch._check(x.shape[-1] == in_features, lambda: "x's last dimension must equal in_features")
    torch._check(x.dtype in (torch.float32, torch.bfloat16), lambda: "x must be float32 or bfloat16")
    return x.new_empty(_out_shape(x, qweight.shape[0]))


# -- FP8 e4m3 weights as checkpoints store them ------------------------------------------------------------------
#: Bytes of float32 weight one tile of :func:`linear_on_tiles` dequantizes (FP8, MXFP4): bounds its temporaries.
TILE_BYTES = 16 << 20
#: Inputs per scale span the kernel takes when a row has several spans (``kernels/linear_fp8.c``).
FP8_SPAN_MULTIPLE = 64


def dequantize_fp8(
    weight: torch.Tensor,
    scales: torch.Tensor,
    block_rows: int,
    block_cols: int,
    dtype: torch.dtype,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The float weight (rows ``rows`` of ``[N, K]``) that e4m3 codes and their float32 scales stand for:
    ``W[n, k] = code[n, k] * scales[n // block_rows, k // block_cols]``, rounded to ``dtype``. Native
    (``lm_dequantize_fp8``, the same values) for float32 and bfloat16 where the kernels are loaded."""
    n0, n1 = rows or (0, weight.shape[0])
    k = weight.shape[1]
    native = dtype in (torch.float32, torch.bfloat16) and weight.stride(1) == 1 and scales.is_contiguous()
    fn = _fn("dequantize_fp8") if native and scales.dtype is torch.float32 else None
    if fn is not None and n1 > n0 and k > 0:
        out = torch.empty((n1 - n0, k), dtype=dtype)
        rc = fn(
            weight.data_ptr(),
            weight.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            block_rows,
            min(block_cols, k),
            n0,
            n1 - n0,
            k,
            out.data_ptr(),
            out.stride(0),
            int(dtype is torch.bfloat16),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"lm_dequantize_fp8 failed ({rc}) for a weight of shape {tuple(weight.shape)}")
        return out
    s = scales.index_select(0, torch.arange(n0, n1) // block_rows)
    if s.shape[1] > 1:
        s = s.repeat_interleave(block_cols, 1)[:, :k]
    return (weight[n0:n1].to(torch.float32) * s).to(dtype)


def linear_on_tiles(
    x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, dequantize: Callable[[tuple[int, int]], torch.Tensor]
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on torch's GEMM for a stored weight ``[n, k]`` that ``dequantize((n0, n1))`` turns into
    x's dtype a tile of output rows at a time (:data:`TILE_BYTES` of float32), each tile's product written into its
    columns of the result: the temporaries stay bounded whatever the layer's size."""
    rows = max(1, TILE_BYTES // (4 * max(k, 1)))
    if rows >= n:
        return F.linear(x, dequantize((0, n)), bias)
    out = x.new_empty(_out_shape(x, n))
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        out[..., n0:n1] = F.linear(x, dequantize((n0, n1)), None if bias is None else bias[n0:n1])
    return out


def linear_fp8_torch(x, weight, scales, bias, block_rows: int, block_cols: int) -> torch.Tensor:
    """``loadmaster::linear_fp8`` on torch's GEMM over tiles (:func:`linear_on_tiles`). Prompts and the fallback
    where the native kernels are not loaded take this."""
    n, k = weight.shape
    return linear_on_tiles(x, n, k, bias, lambda r: dequantize_fp8(weight, scales, block_rows, block_cols, x.dtype, r))


def _check_fp8(x, weight, scales, block_rows: int, block_cols: int) -> None:
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        raise ValueError(f"loadmaster::linear_fp8 takes float32 or bfloat16 x, not {x.dtype}")
    if weight.dtype is not torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"loadmaster::linear_fp8: weight must be float8_e4m3fn [N, K] with contiguous rows, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"loadmaster::linear_fp8: x has {x.shape[-1]} features, the weight {k}")
    if block_rows < 1 or block_cols < 1 or (block_cols < k and block_cols % FP8_SPAN_MULTIPLE):
        raise ValueError(
            f"loadmaster::linear_fp8: a scale block of {block_rows}x{block_cols}; rows >= 1, and columns a multiple "
            f"of {FP8_SPAN_MULTIPLE} or the whole row ({k})"
        )
    want = (-(-n // block_rows), -(-k // block_cols))
    if scales.dtype is not torch.float32 or tuple(scales.shape) != want or not scales.is_contiguous():
        raise ValueError(
            f"loadmaster::linear_fp8: scales must be contiguous float32 {want}, got {scales.dtype} {tuple(scales.shape)}"
        )


def _linear_fp8_cpu(x, weight, scales, bias, block_rows: int, block_cols: int) -> torch.Tensor:
    """``x @ (scales * W)^T (+ bias)`` on the native kernel up to its row limit, else :func:`linear_fp8_torch`."""
    _check_fp8(x, weight, scales, block_rows, block_cols)
    n, k = weight.shape
    args = (weight.data_ptr(), weight.stride(0), scales.data_ptr(), scales.stride(0), block_rows, min(block_cols, k))
    out = _call_quant("linear_fp8", x, bias, n, k, args)
    if out is None:
        out = linear_fp8_torch(x, weight, scales, bias, block_rows, block_cols)
    return out


def _fp8_fake(x, weight, scales, bias, block_rows: int, block_cols: int) -> torch.Tensor:
    return _quant_fake(x, weight, scales, bias, weight.shape[1])


# -- MXFP4 (e2m1 codes in blocks of 32, one e8m0 scale each) as checkpoints store them --------------------------
#: The e2m1 value of each 4-bit code (OCP microscaling; codes 8..15 are the negatives of 0..7).
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Each byte's two values, the low nibble's (the even input) first: one lookup per byte in the torch path.
_MXFP4_PAIRS = torch.tensor([[MXFP4_VALUES[b & 15], MXFP4_VALUES[b >> 4]] for b in range(256)], dtype=torch.float32)


def mxfp4_scales(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes as float32 ``2^(e - 127)``, built as the kernel builds them (``e << 23`` read as a float): exact
    for e = 1..254; e = 0 reads as 0 (not 2^-127) and e = 255 (NaN in the format) as infinity."""
    return (scales.to(torch.int32) << 23).view(torch.float32)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """The float weight (rows ``rows`` of ``[N, K]``) that MXFP4 ``blocks`` ``[N, K/32, 16]`` and e8m0 ``scales``
    ``[N, K/32]`` stand for: ``W[n, 32b + i] = e2m1(code) * 2^(e[n, b] - 127)``, the even input in a byte's low
    nibble. Exact in float32 and bfloat16 (a code's two significant bits times a power of two)."""
    n0, n1 = rows or (0, blocks.shape[0])
    r, nb = n1 - n0, blocks.shape[1]
    pairs = _MXFP4_PAIRS.to(blocks.device).index_select(0, blocks[n0:n1].reshape(-1).to(torch.int32))
    w = pairs.view(r, nb, MXFP4_BLOCK) * mxfp4_scales(scales[n0:n1])[..., None]
    return w.view(r, nb * MXFP4_BLOCK).to(dtype)


def linear_mxfp4_torch(x, blocks, scales, bias) -> torch.Tensor:
    """``loadmaster::linear_mxfp4`` on torch's GEMM over tiles (:func:`linear_on_tiles`). Prompts, products beyond
    the kernel's rows and the fallback where the native kernels are not loaded take this."""
    n, k = blocks.shape[0], blocks.shape[1] * MXFP4_BLOCK
    return linear_on_tiles(x, n, k, bias, lambda r: dequantize_mxfp4(blocks, scales, x.dtype, r))


def _check_mxfp4(x, blocks, scales) -> None:
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        raise ValueError(f"loadmaster::linear_mxfp4 takes float32 or bfloat16 x, not {x.dtype}")
    shape_ok = blocks.dim() == 3 and blocks.shape[2] == MXFP4_BLOCK // 2
    if blocks.dtype is not torch.uint8 or not shape_ok or blocks.stride(2) != 1 or blocks.stride(1) != blocks.shape[2]:
        raise ValueError(
            "loadmaster::linear_mxfp4: blocks must be uint8 [N, K/32, 16] with contiguous rows, got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )
    n, nb = blocks.shape[0], blocks.shape[1]
    if x.shape[-1] != nb * MXFP4_BLOCK:
        raise ValueError(f"loadmaster::linear_mxfp4: x has {x.shape[-1]} features, the blocks {nb * MXFP4_BLOCK}")
    if scales.dtype is not torch.uint8 or tuple(scales.shape) != (n, nb) or scales.stride(1) != 1:
        raise ValueError(
            f"loadmaster::linear_mxfp4: scales must be uint8 [{n}, {nb}] (one e8m0 byte per block) with contiguous "
            f"rows, got {scales.dtype} {tuple(scales.shape)}"
        )


def _linear_mxfp4_cpu(x, blocks, scales, bias) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on the native kernel up to its row limit, else :func:`linear_mxfp4_torch`."""
    _check_mxfp4(x, blocks, scales)
    n, k = blocks.shape[0], blocks.shape[1] * MXFP4_BLOCK
    args = (blocks.data_ptr(), blocks.stride(0), scales.data_ptr(), scales.stride(0))
    out = _call_quant("linear_mxfp4", x, bias, n, k, args)
    if out is None:
        out = linear_mxfp4_torch(x, blocks, scales, bias)
    return out


def _mxfp4_fake(x, blocks, scales, bias) -> torch.Tensor:
    return x.new_empty(_out_shape(x, blocks.shape[0]))


# -- bitsandbytes 4-bit (nf4, fp4) ---------------------------------------------------------------------------------
def dequantize_nf4(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    table: torch.Tensor,
    dtype: torch.dtype,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The float weight (rows ``rows`` of ``[N, K]``) of bitsandbytes 4-bit ``codes`` ``[N, K/2]`` (the first input
    in a byte's high nibble) and float32 ``absmax`` ``[N, K/bs]``: ``W[n, j] = table[code] * absmax[n, j / bs]``,
    one float32 product, as the kernel and bitsandbytes compute it."""
    n0, n1 = rows or (0, codes.shape[0])
    r, k, blocks = n1 - n0, codes.shape[1] * 2, absmax.shape[1]
    w = nibble_values(codes[n0:n1], table).view(r, blocks, k // blocks)
    return (w * absmax[n0:n1, :, None]).view(r, k).to(dtype)


def nibble_values(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The float32 values of 4-bit codes packed two a byte (the high nibble first), flat: one lookup a byte in a
    256-entry table of value pairs, so the index costs half what one a code would."""
    t = table.to(torch.float32)
    pairs = torch.stack([t.repeat_interleave(16), t.repeat(16)], 1)  # byte b -> (table[b >> 4], table[b & 15])
    return pairs.index_select(0, codes.reshape(-1).view(torch.uint8).to(torch.int32)).reshape(-1)


def linear_nf4_torch(x, codes, absmax, table, bias) -> torch.Tensor:
    """``loadmaster::linear_nf4`` on torch's GEMM over tiles (:func:`linear_on_tiles`). Prompts, products beyond
    the kernel's rows and the fallback where the native kernels are not loaded take this."""
    n, k = codes.shape[0], codes.shape[1] * 2
    return linear_on_tiles(x, n, k, bias, lambda r: dequantize_nf4(codes, absmax, table, x.dtype, r))


def _check_nf4(x, codes, absmax, table) -> None:
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        raise ValueError(f"loadmaster::linear_nf4 takes float32 or bfloat16 x, not {x.dtype}")
    if codes.dtype is not torch.uint8 or codes.dim() != 2 or codes.stride(1) != 1:
        raise ValueError(
            f"loadmaster::linear_nf4: codes must be uint8 [N, K/2] with contiguous rows, not {codes.dtype}"
        )
    n, k = codes.shape[0], codes.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"loadmaster::linear_nf4: x has {x.shape[-1]} features, the codes {k}")
    ok = absmax.dtype is torch.float32 and absmax.dim() == 2 and absmax.shape[0] == n and absmax.stride(1) == 1
    if not ok or absmax.shape[1] < 1 or k % absmax.shape[1] or (k // absmax.shape[1]) % 16:
        raise ValueError(
            f"loadmaster::linear_nf4: absmax must be float32 [{n}, K/bs] (bs a multiple of 16 dividing K={k}) with "
            f"contiguous rows, got {absmax.dtype} {tuple(absmax.shape)}"
        )
    if table.dtype is not torch.float32 or table.shape != (16,) or not table.is_contiguous():
        raise ValueError(f"loadmaster::linear_nf4: the table must be 16 contiguous float32 values, not {table.shape}")


def _linear_nf4_cpu(x, codes, absmax, table, bias) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on the native kernel up to its row limit, else :func:`linear_nf4_torch`."""
    _check_nf4(x, codes, absmax, table)
    n, k = codes.shape[0], codes.shape[1] * 2
    bs = k // absmax.shape[1]
    args = (codes.data_ptr(), codes.stride(0), absmax.data_ptr(), absmax.stride(0), bs, table.data_ptr())
    out = _call_quant("linear_nf4", x, bias, n, k, args)
    if out is None:
        out = linear_nf4_torch(x, codes, absmax, table, bias)
    return out


def _nf4_fake(x, codes, absmax, table, bias) -> torch.Tensor:
    return x.new_empty(_out_shape(x, codes.shape[0]))


# -- attention over the slot cache ---------------------------------------------------------------------------------
def _check_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> None:
    b, h, width, d = query.shape
    if key.dim() != 4 or key.shape != value.shape or key.shape[0] != b or key.shape[3] != d or h % key.shape[1]:
        raise ValueError(
            f"loadmaster::decode_attention: query {tuple(query.shape)} does not fit key {tuple(key.shape)} "
            f"and value {tuple(value.shape)} ([B, H, T, D] and [B, KV, L, D] with H a multiple of KV)"
        )
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"loadmaster::decode_attention takes float32 or bfloat16 query, key and value of one dtype, not "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if mask is None and width != 1:
        raise ValueError(
            "loadmaster::decode_attention: several query tokens per row need a mask (which keys each attends)"
        )
    if mask is not None and (
        mask.dtype is not torch.bool
        or mask.dim() != 4
        or mask.shape[-1] != key.shape[2]
        or mask.shape[2] not in (1, width)
    ):
        raise ValueError(
            f"loadmaster::decode_attention: the mask must be bool [B, 1, T, L] (T = {width} query tokens, "
            f"L = {key.shape[2]} keys), not {mask.dtype} {tuple(mask.shape)}"
        )


def _decode_attention_torch(query, key, value, mask, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _decode_attention_cpu(query, key, value, mask, scale: float) -> torch.Tensor:
    """Softmax attention of each row's query tokens over its keys (each token over the keys its mask row lets
    through), as ``[B, T, H, D]`` (the layout transformers' attention functions return). The native kernel when it
    takes the operands (every last dimension contiguous, a head size it handles), else torch's SDPA."""
    _check_attention(query, key, value, mask)
    b, h, width, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    fn = _fn("decode_attention")
    if mask is not None:
        mask = mask.expand(b, 1, width, length)
    contiguous_rows = all(t.stride(-1) == 1 for t in (query, key, value)) and (mask is None or mask.stride(-1) == 1)
    if fn is None or not contiguous_rows:
        return _decode_attention_torch(query, key, value, mask, scale)
    out = torch.empty((b, width, h, d), dtype=query.dtype)
    rc = fn(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        None if mask is None else mask.data_ptr(),
        0 if mask is None else mask.stride(0),
        0 if mask is None else mask.stride(2),
        out.data_ptr(),
        width * h * d,
        h * d,
        d,
        b,
        h,
        kv,
        width,
        length,
        d,
        scale,
        int(query.dtype is torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc != 0:  # a head size or group the kernel does not take
        return _decode_attention_torch(query, key, value, mask, scale)
    return out


def decode_available() -> bool:
    """Whether the native attention kernel is loaded (else the operator runs torch's SDPA)."""
    return _fn("decode_attention") is not None


def _decode_attention_fake(query, key, value, mask, scale: float) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


_lib.impl("linear", _linear_cpu, "CPU")
_lib.impl("linear_multi", _linear_multi_cpu, "CPU")
_lib.impl("linear_q8", _linear_q8_cpu, "CPU")
_lib.impl("linear_q4", _linear_q4_cpu, "CPU")
_lib.impl("linear_q4z", _linear_q4z_cpu, "CPU")
_lib.impl("linear_fp8", _linear_fp8_cpu, "CPU")
_lib.impl("linear_mxfp4", _linear_mxfp4_cpu, "CPU")
_lib.impl("linear_nf4", _linear_nf4_cpu, "CPU")
_lib.impl("decode_attention", _decode_attention_cpu, "CPU")
# Shape functions as Meta kernels, which fake tensors run too. (``torch.library.register_fake`` records each
# caller's source line through ``inspect``, which resolves the path of every module loaded so far: ~40 ms of a
# server's start, for a record only torch's error messages read.)
_lib.impl("linear", _linear_fake, "Meta")
_lib.impl("linear_multi", _linear_multi_fake, "Meta")
_lib.impl("linear_q8", _quant_fake, "Meta")
_lib.impl("linear_q4", _quant_fake, "Meta")
_lib.impl("linear_q4z", _quant_z_fake, "Meta")
_lib.impl("linear_fp8", _fp8_fake, "Meta")
_lib.impl("linear_mxfp4", _mxfp4_fake, "Meta")
_lib.impl("linear_nf4", _nf4_fake, "Meta")
_lib.impl("decode_attention", _decode_attention_fake, "Meta")

linear = torch.ops.loadmaster.linear.default
linear_multi = torch.ops.loadmaster.linear_multi.default
linear_q8 = torch.ops.loadmaster.linear_q8.default
linear_q4 = torch.ops.loadmaster.linear_q4.default
linear_q4z = torch.ops.loadmaster.linear_q4z.default
linear_fp8 = torch.ops.loadmaster.linear_fp8.default
linear_mxfp4 = torch.ops.loadmaster.linear_mxfp4.default
linear_nf4 = torch.ops.loadmaster.linear_nf4.default
decode_attention = torch.ops.loadmaster.decode_attention.default


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the native float kernel takes these operands: a small CPU product in a dtype with a kernel, with
    the kernels loaded. Called once per linear layer per token, so it reads only cheap attributes."""
    dtype = weight.dtype
    kernel = KERNELS.get(dtype)
    if kernel is None or x.dtype is not dtype or not x.is_cpu or not weight.is_cpu:
        return False
    if _fn(kernel.name) is None:
        return False
    k = x.shape[-1]
    if weight.dim() != 2 or weight.stride(1) != 1 or k != weight.shape[1] or k == 0:
        return False
    if not 0 < x.numel() // k <= kernel.max_rows:
        return False
    return not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())
