"""Pre-quantized checkpoints at load: each stored layer (:class:`~planner.model.packed_linear.PackedLinear`) is
repacked once into the native layouts (:mod:`loaders.native.quantization`), where its grid is exactly theirs.

Every format is first read into one form: integer codes ``[N, K]``, a scale and a zero point per group of
``group`` inputs (the dequantized weight is ``scale * (code - zero)``), and the input order (GPTQ act-order's
``g_idx``). Then:

- 4-bit with a group of a multiple of 64 (or per channel): the native int4 layout, one float16 scale per 64
  inputs (each format group's scale repeated), a float16 zero point per group where they are not all 8
  (``linear_q4z``), and act-order's permutation applied to the input. Exact: the same weights, bit for bit
  (compressed-tensors' bfloat16 scales are exact in float16 unless below 2^-14; the log says if any were not);
- 8-bit per channel: the native int8 layout (one float32 scale per row). Exact except codes of -128, which the
  int8 kernel does not take: they become -127 (one step; the log counts them);
- FP8 (compressed-tensors ``float-quantized``, ``fp8`` block-wise): kept as stored, e4m3 bytes and float32 scales,
  for the native FP8 kernel (:class:`~loaders.native.fp8_linear.Fp8CPULinear`), which reads one byte per weight in
  place (a disk layer's from the shard's map). A grid the kernel lacks (a block of inputs not a multiple of 64) is
  dequantized, and the log says so;
- MXFP4 (e2m1 blocks of 32 with e8m0 scales, the gpt-oss layout on linear layers): kept as stored, blocks and
  scale bytes, for the native MXFP4 kernel (:class:`~loaders.native.mxfp4_linear.Mxfp4CPULinear`), which reads half
  a byte per weight in place (a disk layer's from the shard's map). No repacking, no dequantization on the CPU.
  gpt-oss's fused MoE experts (:class:`~planner.model.packed_experts.PackedExperts`) likewise, each hit expert's
  slice on the same kernel (:class:`~loaders.native.mxfp4_experts.Mxfp4Experts`);
- bitsandbytes ``load_in_8bit`` (``weight`` int8 and ``SCB``): the native int8 layout, scale ``SCB / 127`` per
  row: exactly our int8 grid (bitsandbytes writes codes -127..127);
- bitsandbytes ``load_in_4bit`` (nf4, fp4, with or without double quant): kept as stored, codes and float32
  absmax (double quant's decoded once), for the native float-table kernel
  (:class:`~loaders.native.bnb_4bit.Bnb4CPULinear`: nf4's values are no integer grid, so no int4 layout holds
  them), which reads half a byte per weight in place (a disk layer's from the shard's map). A layer whose blocks
  straddle rows (``in_features`` not a multiple of the block size), or one on a GPU, is dequantized once to the
  compute dtype (equal to bitsandbytes' own ``dequantize_4bit`` bit for bit in float32), and the log says so;
- everything else (8-bit in groups): dequantized to the compute dtype, and the log says so, since the native
  kernels have no layout for it yet. On a GPU (``native=False``) every layer is dequantized on its device.

Reference layouts (the format's own packing, each checked in tests against the package where it installs):
GPTQ ``qweight`` int32 ``[K*b/32, N]`` packed along inputs, low bits first, ``qzeros`` int32 ``[G, N*b/32]`` along
outputs (stored minus one in the original ``gptq`` format), ``scales`` ``[G, N]``, ``g_idx`` ``[K]``; AWQ GEMM
``qweight`` int32 ``[K, N/8]`` with the nibbles of each word holding outputs 0, 2, 4, 6, 1, 3, 5, 7, ``qzeros``
alike, ``scales`` ``[G, N]``; compressed-tensors ``weight_packed`` int32 ``[N, K*b/32]`` along inputs, codes
offset by ``2^(b-1)``, ``weight_scale`` ``[N, G]``, ``weight_zero_point`` packed along outputs; FP8 ``weight``
e4m3 ``[N, K]`` times ``weight_scale`` (per channel or tensor) or ``weight_scale_inv`` per block; MXFP4
``weight_blocks`` uint8 ``[N, K/32, 16]``, the even input in the low nibble, times ``2^(weight_scales - 127)``
(checked in tests against transformers' own dequantizer, ``convert_moe_packed_tensors``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from loaders.checkpoint.device_order import is_under
from loaders.native.bnb_4bit import Bnb4CPULinear, dequantize_bnb_4bit
from loaders.native.fp8_linear import Fp8CPULinear
from loaders.native.mxfp4_experts import Mxfp4Experts, dequantized_experts
from loaders.native.mxfp4_linear import Mxfp4CPULinear
from loaders.native.operators import GROUP, dequantize_mxfp4
from loaders.native.quantization import QuantizedCPULinear
from loaders.native.repack_cache import RepackCache, layer_tensors
from planner.hardware.units import format_bytes
from planner.model.packed_experts import PackedExperts
from planner.model.packed_linear import PackedLinear
from planner.model.quant_config import BNB_4BIT_LAYOUTS, FP8_LAYOUTS, MXFP4_LAYOUT, QuantFormat

log = logging.getLogger(__name__)

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + _AWQ_ORDER[i]


@dataclass
class PackedStats:
    """What :func:`repack_packed_linears` did, for ``load_stats`` and the log."""

    layers: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    clamped_codes: int = 0
    inexact_scales: int = 0
    seconds: float = 0.0
    #: The file the repacked layers were read from or saved to (:mod:`loaders.native.repack_cache`), if any.
    file: str | None = None
    from_file: bool = False
    #: The layers the plan put on disk that were repacked, and the file ranges they now read, by tensor name.
    disk_layers: set[str] = field(default_factory=set)
    file_ranges: dict[str, tuple[str, int, int]] = field(default_factory=dict)


@dataclass
class Grid:
    """A layer's weight as ``scale * (code - zero)``: codes ``[N, K]`` (int32), scales and zeros ``[N, G]``
    (float32) for groups of ``group`` inputs along ``order`` (``None``: the stored input order)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int
    bits: int
    order: torch.Tensor | None = None


def _unpack_int32(words: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    """Codes packed ``32 // bits`` to an int32 along ``dim``, lowest bits first, as int32 ``[.., count, ..]``."""
    per = 32 // bits
    w = words.to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    if dim == 0:
        codes = (w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return codes.reshape(-1, w.shape[1])[:count]
    codes = (w[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return codes.reshape(w.shape[0], -1)[:, :count]


def _gptq_grid(m: PackedLinear, fmt: QuantFormat) -> Grid:
    n, k, b = m.out_features, m.in_features, fmt.bits
    codes = _unpack_int32(m.qweight, b, 0, k).t()  # [N, K]
    scales = m.scales.to(torch.float32).t()  # [N, G]
    zeros = _unpack_int32(m.qzeros, b, 1, n).t().to(torch.float32)  # [N, G]
    if fmt.zeros_minus_one:
        zeros = (zeros + 1) % (1 << b) if b < 8 else zeros + 1
    group = fmt.group_size if fmt.group_size > 0 else k
    g_idx = getattr(m, "g_idx", None)
    order = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k) // group):
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], torch.arange(k) // group):  # groups of uneven sizes: per input
                return Grid(codes, scales[:, g_idx], zeros[:, g_idx], 1, b)
            codes = codes[:, order]  # position j now holds input order[j], of group j // group
    return Grid(codes, scales, zeros, group, b, order)


def _awq_grid(m: PackedLinear, fmt: QuantFormat) -> Grid:
    n, k = m.out_features, m.in_features
    inv = torch.tensor([_AWQ_ORDER.index(j) for j in range(8)])

    def unpack(words: torch.Tensor) -> torch.Tensor:
        raw = _unpack_int32(words, 4, 1, words.shape[1] * 8).view(words.shape[0], -1, 8)
        return raw[:, :, inv].reshape(words.shape[0], -1)[:, :n]

    codes = unpack(m.qweight).t()  # [N, K]
    zeros = unpack(m.qzeros).t().to(torch.float32)
    scales = m.scales.to(torch.float32).t()
    return Grid(codes, scales, zeros, fmt.group_size if fmt.group_size > 0 else k, 4)


def _ct_int_grid(m: PackedLinear, fmt: QuantFormat) -> Grid:
    n, k, b = m.out_features, m.in_features, fmt.bits
    off = 1 << (b - 1)
    if fmt.layout == "ct-pack":
        codes = _unpack_int32(m.weight_packed, b, 1, k)  # offset codes, 0 .. 2^b - 1
    else:
        codes = m.weight.to(torch.int32) + off
    scales = m.weight_scale.to(torch.float32).reshape(n, -1) if m.weight_scale.dim() else m.weight_scale.view(1, 1)
    scales = scales.expand(n, -1)
    zp = getattr(m, "weight_zero_point", None)
    if zp is None or fmt.sym:
        zeros = torch.full_like(scales, float(off))
    elif fmt.layout == "ct-pack":
        zeros = _unpack_int32(zp, b, 0, n).to(torch.float32).reshape(n, -1)
    else:
        zeros = zp.to(torch.float32).reshape(n, -1) + off
    group = fmt.group_size if fmt.group_size > 0 else k
    return Grid(codes, scales, zeros, group, b)


def _bnb_int8_grid(m: PackedLinear, fmt: QuantFormat) -> Grid:
    """bitsandbytes ``load_in_8bit`` as saved: int8 codes, each row's absmax ``SCB`` (the scale ``SCB / 127``)."""
    scales = (m.SCB.to(torch.float32) / 127.0).reshape(-1, 1)
    return Grid(m.weight.to(torch.int32), scales, torch.zeros_like(scales), m.in_features, 8)


_GRIDS = {
    "gptq": _gptq_grid,
    "awq": _awq_grid,
    "ct-pack": _ct_int_grid,
    "ct-int": _ct_int_grid,
    "bnb-int8": _bnb_int8_grid,
}


def _per_native_group(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """``[N, G]`` per format group -> ``[N, ceil(K/64)]`` per native group (each repeated group/64 times)."""
    g64 = (k + GROUP - 1) // GROUP
    idx = torch.arange(g64) * GROUP // group
    return t[:, idx.clamp_(max=t.shape[1] - 1)]


def _to_int4(m: PackedLinear, grid: Grid, stats: PackedStats) -> QuantizedCPULinear:
    n, k = m.out_features, m.in_features
    g64 = (k + GROUP - 1) // GROUP
    codes = torch.full((n, g64 * GROUP), 8, dtype=torch.uint8)
    codes[:, :k] = grid.codes.to(torch.uint8)
    codes = codes.view(n, g64, GROUP)
    packed = (codes[:, :, : GROUP // 2] | (codes[:, :, GROUP // 2 :] << 4)).reshape(n, -1).contiguous()
    s32 = _per_native_group(grid.scales, grid.group, k)
    scales = s32.to(torch.float16)
    if not torch.equal(scales.to(torch.float32), s32):
        stats.inexact_scales += 1
    z = _per_native_group(grid.zeros, grid.group, k)
    zeros = None if bool((z == 8).all()) else z.to(torch.float16).contiguous()
    bias = m.bias.detach() if m.bias is not None else None
    order = grid.order.contiguous() if grid.order is not None else None
    return QuantizedCPULinear("int4", k, n, packed, scales.contiguous(), bias, zeros, order)


def _to_int8(m: PackedLinear, grid: Grid, stats: PackedStats) -> QuantizedCPULinear:
    n, k = m.out_features, m.in_features
    g64 = (k + GROUP - 1) // GROUP
    signed = grid.codes - grid.zeros.to(torch.int32)  # per channel: one zero per row
    stats.clamped_codes += int((signed < -127).sum())
    q = torch.zeros((n, g64 * GROUP), dtype=torch.int8)
    q[:, :k] = signed.clamp_(-127, 127).to(torch.int8)
    bias = m.bias.detach() if m.bias is not None else None
    return QuantizedCPULinear("int8", k, n, q, grid.scales[:, 0].contiguous(), bias, None, grid.order)


def dequantize_grid(grid: Grid, k: int) -> torch.Tensor:
    """The float32 weight ``[N, K]`` a grid stands for, in the stored input order."""
    idx = torch.arange(k) // grid.group
    w = (grid.codes.to(torch.float32) - grid.zeros[:, idx]) * grid.scales[:, idx]
    if grid.order is not None:
        w = torch.empty_like(w).index_copy_(1, grid.order, w)
    return w


def dequantize_fp8(m: PackedLinear, fmt: QuantFormat) -> torch.Tensor:
    """The float32 weight of an FP8 layer: e4m3 codes times their per-block, per-channel or per-tensor scale."""
    w = m.weight.to(torch.float32)
    n, k = w.shape
    if fmt.layout == "fp8-block":
        bn, bk = fmt.block or (128, 128)
        s = m.weight_scale_inv.to(torch.float32)
        return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    s = m.weight_scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(1, 1)
    s = s.reshape(n, -1)  # per channel, or per group of inputs
    if s.shape[1] == 1:
        return w * s
    return w * s.repeat_interleave(fmt.group_size if fmt.group_size > 0 else -(-k // s.shape[1]), 1)[:, :k]


def _dequantized(m: PackedLinear, weight: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta", dtype=dtype)
    lin.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if m.bias is not None:
        lin.bias = nn.Parameter(m.bias.detach(), requires_grad=False)
    return lin


def repack(
    m: PackedLinear | PackedExperts, dtype: torch.dtype, stats: PackedStats, native: bool = True, name: str = "layer"
) -> tuple[nn.Module, str]:
    """The runnable layer for one stored layer (``name``, for errors), and the kind it became (``native``: False on
    a GPU, where every layer is dequantized)."""
    fmt = m.fmt
    if isinstance(m, PackedExperts):  # gpt-oss's MXFP4 experts
        if native:
            return Mxfp4Experts(m), "mxfp4 experts"
        return dequantized_experts(m, dtype), f"mxfp4 experts -> {str(dtype).removeprefix('torch.')}"
    if fmt.layout in BNB_4BIT_LAYOUTS.values():
        quant_type = fmt.layout.removeprefix("bnb-")
        layer = Bnb4CPULinear.from_packed(m, name) if native else None
        if layer is not None:
            return layer, quant_type
        kind = f"{quant_type} -> {str(dtype).removeprefix('torch.')}"
        return _dequantized(m, dequantize_bnb_4bit(m, name), dtype), kind
    if fmt.layout in FP8_LAYOUTS:
        layer = Fp8CPULinear.from_packed(m) if native else None
        if layer is not None:
            return layer, "fp8"
        return _dequantized(m, dequantize_fp8(m, fmt), dtype), f"fp8 -> {str(dtype).removeprefix('torch.')}"
    if fmt.layout == MXFP4_LAYOUT:
        if native:
            return Mxfp4CPULinear.from_packed(m), "mxfp4"
        weight = dequantize_mxfp4(m.weight_blocks, m.weight_scales, torch.float32)
        return _dequantized(m, weight, dtype), f"mxfp4 -> {str(dtype).removeprefix('torch.')}"
    if not native:
        weight = dequantize_grid(_GRIDS[fmt.layout](m, fmt), m.in_features)
        return _dequantized(m, weight, dtype), f"int{fmt.bits} -> {str(dtype).removeprefix('torch.')}"
    grid = _GRIDS[fmt.layout](m, fmt)
    per_channel = grid.group >= m.in_features
    if grid.bits == 4 and (per_channel or grid.group % GROUP == 0):
        return _to_int4(m, grid, stats), "int4"
    if grid.bits == 8 and per_channel and grid.order is None:
        return _to_int8(m, grid, stats), "int8"
    weight = dequantize_grid(grid, m.in_features)
    return _dequantized(m, weight, dtype), f"int{grid.bits} -> {str(dtype).removeprefix('torch.')}"


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _map_saved(
    model: nn.Module, cache: RepackCache, layers: list[str], fresh: dict[str, QuantizedCPULinear], stats: PackedStats
) -> None:
    """Save the layers repacked by this load (``fresh``) with any already saved, then put every one of them on the
    file's map, so that what the process holds is the map, as on every later load."""
    for name, mod in model.named_modules():
        if name in layers and name not in fresh and isinstance(mod, QuantizedCPULinear):
            fresh[name] = mod  # read from a file that lacked others: the new file holds them all
    entries = cache.save(layers, fresh)
    for name, lin in fresh.items():
        mapped = cache.layer(name, entries.get(name, {}), lin.bias, lin.in_features, lin.out_features)
        if mapped is not None:
            _set_module(model, name, mapped)
    stats.file = str(cache.path_and_key(layers)[0])


def _note_disk_layers(
    model: nn.Module, stats: PackedStats, disk_tensors: Collection[str], cache: RepackCache | None
) -> None:
    """Record the file ranges the disk layers now read (for the readahead), or say what a disk layer repacked
    into memory costs when there is no folder to keep it on disk."""
    disk_layers = {t.rpartition(".")[0] for t in disk_tensors}
    held = 0
    for name, mod in model.named_modules():
        if name not in disk_layers or not isinstance(mod, QuantizedCPULinear):
            continue
        stats.disk_layers.add(name)
        for suffix, t in layer_tensors(mod).items():
            where = cache.reader.range_of(t) if cache is not None else None
            if where is None:
                held += t.numel() * t.element_size()
            else:
                stats.file_ranges[f"{name}.{suffix}"] = where
    if held:
        log.warning(
            "%s of layers planned on disk were repacked into memory: give cpu_quantized_dir "
            "(--cpu-quantized-dir) to save them once and read them from that file instead",
            format_bytes(held),
        )


def repack_packed_linears(
    model: nn.Module,
    dtype: torch.dtype,
    native: bool = True,
    cache: RepackCache | None = None,
    disk_tensors: Collection[str] = (),
    cpu_computed: Collection[str] = (),
) -> PackedStats | None:
    """Replace every stored layer of a loaded ``model`` with its runnable form (see the module docstring); None
    when the model has none. Layers dequantized for want of a native layout are said in the log. ``native``:
    False where GPUs compute (every layer is then dequantized on its device). ``cache``: where the int4/int8
    repacked layers are saved once and mapped from (:mod:`loaders.native.repack_cache`); ``disk_tensors``: the
    names of the tensors the plan put on disk, whose layers, repacked without a cache, are held in memory (the log
    says how much). ``cpu_computed``: the keys of modules the CPU computes while GPUs compute the rest (routed
    experts kept in host RAM, a plan's CPU layers): their stored layers take the native CPU kernels even where
    ``native`` is False, instead of being dequantized in host RAM (gpt-oss's MXFP4 experts would grow fourfold)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (PackedLinear, PackedExperts))]
    if not layers:
        return None
    t0 = time.perf_counter()
    stats = PackedStats()
    on_cpu = {
        name: (native or is_under(name, cpu_computed)) and next(m.buffers()).device.type == "cpu" for name, m in layers
    }
    cacheable = [name for name, m in layers if on_cpu[name] and m.fmt.layout in _GRIDS]
    saved = cache.entries(cacheable) if cache is not None and cacheable else None
    stats.from_file = saved is not None
    stats.file = str(cache.path_and_key(cacheable)[0]) if saved is not None else None
    fresh: dict[str, QuantizedCPULinear] = {}
    for name, m in layers:
        new = None
        if saved is not None and name in saved:
            new = cache.layer(
                name, saved[name], m.bias.detach() if m.bias is not None else None, m.in_features, m.out_features
            )
        if new is not None:
            kind = new.scheme
        else:
            new, kind = repack(m, dtype, stats, on_cpu[name], name)
            if isinstance(new, QuantizedCPULinear):
                fresh[name] = new
        _set_module(model, name, new)
        stats.layers += 1
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1
    if cache is not None and fresh:
        _map_saved(model, cache, cacheable, fresh, stats)
    _note_disk_layers(model, stats, disk_tensors, cache)
    stats.seconds = time.perf_counter() - t0
    fmt = layers[0][1].fmt
    source = f" (read from {stats.file})" if stats.from_file else f" (saved to {stats.file})" if stats.file else ""
    log.info("%d %s layers repacked in %.2fs: %s%s", stats.layers, fmt.describe, stats.seconds, stats.kinds, source)
    for kind, count in stats.kinds.items():
        if kind.startswith(tuple(BNB_4BIT_LAYOUTS)) and "->" in kind:
            log.warning(
                "%d %s layers were dequantized to %s at load: nf4 and fp4 have no native kernel on a GPU or for "
                "blocks that straddle rows, so they hold and read the compute dtype's bytes, not the stored 4 bits",
                count,
                fmt.describe,
                kind.partition(" -> ")[2],
            )
        elif "->" in kind:
            log.warning(
                "%d %s layers have no native kernel for their grid and were dequantized (%s): they hold and read "
                "the compute dtype's bytes, not the stored ones",
                count,
                fmt.describe,
                kind,
            )
    if stats.clamped_codes:
        log.warning("%d int8 codes of -128 became -127 (the int8 kernel takes -127..127)", stats.clamped_codes)
    if stats.inexact_scales:
        log.warning("%d layers' scales were rounded to float16 (the native int4 layout's)", stats.inexact_scales)
    return stats
