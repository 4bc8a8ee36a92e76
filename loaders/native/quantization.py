"""Weight-only int8 and 4-bit linear layers for the CPU: quantized at load, optionally saved as safetensors.

Why: decode on the CPU reads every weight once per token, so its speed is bytes per token. int8 (one scale per
output channel) reads half of bf16's bytes, 4-bit (one float16 scale per group of 64 inputs) about 28%. The
native kernels (``kernels/linear_q8.c``, ``linear_q4.c``, through :mod:`loaders.native.operators`) read these layouts
in place, so a saved file is served straight from its memory map, like a bf16 checkpoint.

- ``int8``: ``qweight`` int8 ``[N, G*64]`` (rows zero-padded to a whole number of 64-input groups), values in
  [-127, 127]; ``scales`` float32 ``[N]``: ``W[n, k] = scales[n] * qweight[n, k]``.
- ``int4``: ``qweight`` uint8 ``[N, G*32]``, two 4-bit codes per byte (the layout ``linear_q4.c`` describes);
  ``scales`` float16 ``[N, G]``: ``W[n, k] = scales[n, k // 64] * (code - 8)``. The output head stays int8
  under ``int4``: it is one layer, and its errors reach every logit directly.

The shapes and dtypes come from :func:`planner.placement.sizing.cpu_quantized_layout`, which the planner sizes these layers
by, so a plan made with ``cpu_quantization`` budgets exactly the bytes allocated here.

bitsandbytes (``quantization=`` in :func:`loaders.load_model`) stays the path for GPU layers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from loaders.native import operators
from loaders.native.operators import GROUP
from planner.placement.sizing import CPU_QUANT_GROUP, QuantizedLayout, cpu_quantized_layout

if GROUP != CPU_QUANT_GROUP:  # pragma: no cover - the kernels and the planner's sizing share one group size
    raise ImportError(f"kernel group {GROUP} differs from the planner's {CPU_QUANT_GROUP}")

log = logging.getLogger(__name__)

#: Values of ``load_model(cpu_quantization=...)``.
CPU_QUANTIZATION_CHOICES = ("int8", "int4")
#: Changes whenever the layouts above change, so files saved by another version are not trusted.
FORMAT_VERSION = "1"
_ROWS_PER_CHUNK = 1024  # bounds the float temporaries of quantization to a few MiB per chunk


@dataclass
class QuantizationStats:
    """What :func:`quantize_cpu_linears` did, for ``load_stats``."""

    scheme: str
    layers: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    #: The safetensors file the quantized weights were read from (a memory map) or written to; None if not saved.
    file: str | None = None
    from_file: bool = False
    schemes: dict[str, int] = field(default_factory=dict)


def check_cpu_quantization(
    scheme: str | None,
    gpu_quantization: str | None,
    save_dir,
    dtype: torch.dtype | None = None,
    prequantized: bool = False,
) -> None:
    """Refuse combinations that would be ignored or ambiguous, before any weight is loaded. ``prequantized``: the
    checkpoint stores quantized layers, whose repacked copies ``save_dir`` keeps (:mod:`loaders.native.repack_cache`)."""
    from planner.errors import PlanError

    if scheme is None:
        if save_dir is not None and not prequantized:
            raise PlanError(
                "cpu_quantized_dir was given without cpu_quantization, and the checkpoint is not pre-quantized: "
                f"name the scheme to save ({' or '.join(CPU_QUANTIZATION_CHOICES)}), or drop the folder."
            )
        return
    if scheme not in CPU_QUANTIZATION_CHOICES:
        raise PlanError(f"cpu_quantization={scheme!r} is not one of {', '.join(CPU_QUANTIZATION_CHOICES)}.")
    if gpu_quantization:
        raise PlanError(
            f"cpu_quantization={scheme!r} and quantization={gpu_quantization!r} were both given. "
            "quantization= is bitsandbytes for GPU layers, cpu_quantization= is for CPU and disk "
            "layers with no GPU in the map; pass the one that matches the device map."
        )
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        raise PlanError(
            f"cpu_quantization={scheme!r} computes with float32 or bfloat16 activations, not "
            f"{str(dtype).removeprefix('torch.')}: load with dtype='bfloat16' or 'float32'."
        )


def _groups(k: int) -> int:
    return (k + GROUP - 1) // GROUP


def _allocate(weight: torch.Tensor, scheme: str, zeroed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(qweight, scales)`` of the layout the planner sizes (:func:`cpu_quantized_layout`)."""
    n, k = weight.shape
    lay = cpu_quantized_layout(n, k, scheme)
    make = torch.zeros if zeroed else torch.empty
    return make(lay.qweight_shape, dtype=getattr(torch, lay.qweight_dtype)), torch.empty(
        lay.scales_shape, dtype=getattr(torch, lay.scales_dtype)
    )


def _matches(t: torch.Tensor | None, shape: tuple[int, ...], dtype: str) -> bool:
    return t is not None and tuple(t.shape) == shape and t.dtype == getattr(torch, dtype)


_WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _native_quantizer(name: str, weight: torch.Tensor):
    """The native quantizer (``kernels/quantize_weights.c``) if it takes this weight, else None (torch runs)."""
    from loaders.native import kernel_build

    if weight.dtype not in _WEIGHT_DTYPES or not weight.is_cpu or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    return kernel_build.function(name) if kernel_build.status().available else None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight int8 [N, G*64], scales float32 [N])`` of a float weight ``[N, K]``: symmetric, per channel.

    Native where the kernels are loaded (the same bytes as :func:`quantize_int8_torch`, multi-threaded)."""
    fn = _native_quantizer("quantize_q8", weight)
    if fn is None:
        return quantize_int8_torch(weight)
    n, k = weight.shape
    q, scales = _allocate(weight, "int8")
    if (
        fn(
            weight.data_ptr(),
            weight.stride(0),
            _WEIGHT_DTYPES[weight.dtype],
            n,
            k,
            q.data_ptr(),
            q.stride(0),
            scales.data_ptr(),
            torch.get_num_threads(),
        )
        != 0
    ):
        raise RuntimeError(f"lm_quantize_q8 rejected a weight of shape {tuple(weight.shape)}")
    return q, scales


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [N, G*32], scales float16 [N, G])`` of a float weight ``[N, K]`` (see
    :func:`quantize_int4_torch`); native where the kernels are loaded, with the same bytes."""
    fn = _native_quantizer("quantize_q4", weight)
    if fn is None:
        return quantize_int4_torch(weight)
    n, k = weight.shape
    packed, scales = _allocate(weight, "int4")
    if (
        fn(
            weight.data_ptr(),
            weight.stride(0),
            _WEIGHT_DTYPES[weight.dtype],
            n,
            k,
            packed.data_ptr(),
            packed.stride(0),
            scales.data_ptr(),
            scales.stride(0),
            torch.get_num_threads(),
        )
        != 0
    ):
        raise RuntimeError(f"lm_quantize_q4 rejected a weight of shape {tuple(weight.shape)}")
    return packed, scales


def quantize_int8_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8` in torch operations (where the native kernels are not loaded)."""
    n, k = weight.shape
    q, scales = _allocate(weight, "int8", zeroed=True)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        w = weight[r0 : r0 + _ROWS_PER_CHUNK].to(torch.float32)
        s = w.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[r0 : r0 + _ROWS_PER_CHUNK, :k] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[r0 : r0 + _ROWS_PER_CHUNK] = s
    return q, scales


_F16_MAX_BITS = 0x7BFF  # the bits of float16's largest finite magnitude: a scale there is never stepped to inf


def quantize_int4_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [N, G*32], scales float16 [N, G])`` of a float weight ``[N, K]``, in torch operations.

    Per group of 64 inputs, the value of largest magnitude maps to code 0 (``-8 * scale``), so the whole range
    -8..7 is used; the scale is rounded to float16 before the codes are chosen, so they match the stored scale.
    Where rounding to nearest would shrink the scale, it is stepped one float16 ulp away from zero instead: a
    value of the opposite sign and the same magnitude clamps at code 15, and with a shrunk scale it would land
    more than one step from its code.
    """
    n, k = weight.shape
    g = _groups(k)
    packed, scales = _allocate(weight, "int4")
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        w = weight[r0 : r0 + _ROWS_PER_CHUNK].to(torch.float32)
        rows = w.shape[0]
        if k % GROUP:
            w = torch.nn.functional.pad(w, (0, g * GROUP - k))
        w = w.view(rows, g, GROUP)
        idx = w.abs().argmax(dim=2, keepdim=True)
        exact = torch.gather(w, 2, idx) / -8.0
        d = exact.to(torch.float16)
        bits = d.view(torch.int16)
        shrunk = (d.to(torch.float32).abs() < exact.abs()) & ((bits & 0x7FFF) < _F16_MAX_BITS)
        d = torch.where(shrunk, bits + 1, bits).view(torch.float16)  # +1 on the bits: one ulp further from zero
        df = d.to(torch.float32)
        inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
        codes = torch.round(w * inv + 8.0).clamp_(0, 15).to(torch.uint8)
        packed[r0 : r0 + rows] = (codes[:, :, : GROUP // 2] | (codes[:, :, GROUP // 2 :] << 4)).reshape(rows, -1)
        scales[r0 : r0 + rows] = d.view(rows, g)
    return packed, scales


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


class QuantizedCPULinear(nn.Module):
    """A linear layer whose weight is held int8 or 4-bit (see the module docstring) and multiplied by the native
    quantized kernels; products with more rows than the kernels take (long prefills) dequantize and use torch."""

    def __init__(
        self,
        scheme: str,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        zeros: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
    ):
        """``zeros`` (int4 only): a float16 zero point per group in place of the 8 (asymmetric GPTQ/AWQ layers);
        ``perm``: the input order the rows are stored in (GPTQ act-order), applied to each input first."""
        super().__init__()
        if scheme not in QUANTIZERS:
            raise ValueError(f"unknown CPU quantization {scheme!r}; use one of {', '.join(CPU_QUANTIZATION_CHOICES)}")
        if zeros is not None and scheme != "int4":
            raise ValueError("zero points are only for the int4 layout")
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("perm", perm)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._op = operators.linear_q8 if scheme == "int8" else operators.linear_q4

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str) -> QuantizedCPULinear:
        q, s = QUANTIZERS[scheme](linear.weight.detach())
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(scheme, linear.in_features, linear.out_features, q, s, bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.zeros is not None:
            w = operators.dequantize_int4_zeros(self.qweight, self.scales, self.zeros, self.in_features, dtype)
        else:
            deq = operators.dequantize_int8 if self.scheme == "int8" else operators.dequantize_int4
            w = deq(self.qweight, self.scales, self.in_features, dtype)
        if self.perm is not None:  # column j holds input perm[j]
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        if self.perm is not None:
            input = input.index_select(-1, self.perm)
        if self.zeros is not None:
            return operators.linear_q4z(input, self.qweight, self.scales, self.zeros, self.bias, self.in_features)
        return self._op(input, self.qweight, self.scales, self.bias, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def _eligible(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Linear layers (plain or native-kernel ones) with a float weight on the CPU or a memory map."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    ]


def _scheme_for(name: str, model: nn.Module, scheme: str) -> str:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if scheme == "int4" and head is not None and model.get_submodule(name) is head:
        return "int8"
    return scheme


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def cache_key(checkpoint_files: list[tuple[str, int, int]], scheme: str, names: list[str]) -> str:
    """Identifies a quantized file: the checkpoint's shards (name, size, mtime), the scheme, the layers, the format."""
    doc = json.dumps(
        {
            "files": [(Path(p).name, size, mtime) for p, size, mtime in checkpoint_files],
            "scheme": scheme,
            "layers": names,
            "format": FORMAT_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(doc.encode()).hexdigest()[:20]


def file_metadata(key: str, scheme: str) -> dict[str, str]:
    return {"loadmaster_cpu_quantization": scheme, "loadmaster_key": key, "format_version": FORMAT_VERSION}


def saved_header(path: Path, key: str, scheme: str, what: str = "quantized"):
    """The safetensors header of a file saved for this load (``key``, ``scheme``), or None when it is absent, or
    unreadable or made for another checkpoint, scheme or format (said in the log: the caller makes it again)."""
    from planner.errors import HeaderError
    from planner.model.safetensors_header import read_header

    if not path.is_file():
        return None
    # This one file's header, not the folder's: files of other schemes or checkpoints may sit next to it.
    try:
        header = read_header(path)
    except HeaderError as exc:
        log.warning("ignoring the %s file %s (%s); making it again", what, path, exc)
        return None
    if header.metadata != file_metadata(key, scheme):
        log.warning("ignoring the %s file %s: it was made for another checkpoint, scheme or format", what, path)
        return None
    return header


def _read_saved(path: Path, key: str, scheme: str, layers: dict[str, tuple[nn.Linear, str]]) -> dict | None:
    """The saved tensors as memory maps of ``path``, or None when the file is absent or not for this load."""
    from loaders.checkpoint.index import ShardEntry
    from loaders.checkpoint.shard_reader import ShardReader

    header = saved_header(path, key, scheme)
    if header is None:
        return None
    reader = ShardReader()
    tensors = {
        name: reader.mapped(
            ShardEntry(name, str(path), getattr(torch, t.dtype), t.shape, t.offset, t.offset + t.nbytes)
        )
        for name, t in header.tensors.items()
    }
    for name, (lin, sch) in layers.items():
        q, s = tensors.get(f"{name}.qweight"), tensors.get(f"{name}.scales")
        lay: QuantizedLayout = cpu_quantized_layout(lin.out_features, lin.in_features, sch)
        if not (_matches(q, lay.qweight_shape, lay.qweight_dtype) and _matches(s, lay.scales_shape, lay.scales_dtype)):
            log.warning("ignoring the quantized file %s: %s is missing or has the wrong shape", path, name)
            return None
    return tensors


def write_saved(path: Path, key: str, scheme: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=file_metadata(key, scheme))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def quantize_cpu_linears(
    model: nn.Module,
    scheme: str,
    *,
    checkpoint_files: list[tuple[str, int, int]],
    save_dir: Path | None = None,
    release: Callable[[torch.Tensor], None] | None = None,
) -> QuantizationStats:
    """Replace every CPU linear layer of ``model`` with a :class:`QuantizedCPULinear` of ``scheme``.

    With ``save_dir``, the quantized tensors are read from ``save_dir/<scheme>-<key>.safetensors`` as a memory
    map when a file for this checkpoint, scheme and format is there, and written there otherwise (atomically).
    ``release`` is called with each float weight once its layer is replaced (the loader gives a shard map's pages
    back there, so the page cache never holds the whole float model).
    """
    import time

    if scheme not in QUANTIZERS:
        raise ValueError(f"cpu_quantization={scheme!r} is not one of {', '.join(CPU_QUANTIZATION_CHOICES)}.")
    t0 = time.perf_counter()
    stats = QuantizationStats(scheme)
    layers = {name: (lin, _scheme_for(name, model, scheme)) for name, lin in _eligible(model)}
    saved_path = None
    saved = None
    key = cache_key(checkpoint_files, scheme, sorted(layers))
    if save_dir is not None:
        saved_path = Path(save_dir) / f"{scheme}-{key}.safetensors"
        saved = _read_saved(saved_path, key, scheme, layers)
        stats.file = str(saved_path)
        stats.from_file = saved is not None
    to_save: dict[str, torch.Tensor] = {}
    for name, (lin, sch) in layers.items():
        stats.bytes_before += lin.weight.numel() * lin.weight.element_size()
        bias = lin.bias.detach() if lin.bias is not None else None
        if saved is not None:
            q, s = saved[f"{name}.qweight"], saved[f"{name}.scales"]
        else:
            q, s = QUANTIZERS[sch](lin.weight.detach())
            to_save[f"{name}.qweight"], to_save[f"{name}.scales"] = q, s
        _set_module(model, name, QuantizedCPULinear(sch, lin.in_features, lin.out_features, q, s, bias))
        if release is not None:
            release(lin.weight)
        stats.bytes_after += q.numel() * q.element_size() + s.numel() * s.element_size()
        stats.layers += 1
        stats.schemes[sch] = stats.schemes.get(sch, 0) + 1
    if saved_path is not None and saved is None and to_save:
        write_saved(saved_path, key, scheme, to_save)
    stats.seconds = time.perf_counter() - t0
    log.info(
        "%d CPU linear layers as %s (%s): %.2f GiB -> %.2f GiB in %.1fs%s",
        stats.layers,
        scheme,
        stats.schemes,
        stats.bytes_before / 2**30,
        stats.bytes_after / 2**30,
        stats.seconds,
        f" ({'read from' if stats.from_file else 'saved to'} {saved_path})" if saved_path else "",
    )
    return stats
