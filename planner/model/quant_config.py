"""Pre-quantized checkpoints: what a ``quantization_config`` in ``config.json`` says, checked, as plain data.

GPTQ, AWQ, compressed-tensors, FP8 and MXFP4 checkpoints store each quantized linear layer as packed tensors next to
its module name (``q_proj.qweight``, ``q_proj.scales``, ...) instead of a ``weight``. The planner sizes those
tensors as stored (:mod:`planner.model.packed_linear` puts them in the meta model, the walk marks them
``packed``, :func:`planner.placement.sizing.tensor_bytes` keeps their stored bytes); the loader repacks them
(:mod:`loaders.native.packed_formats`). A linear layer counts as quantized when the checkpoint stores its
format's marker tensor (:attr:`QuantFormat.marker`); layers the format leaves alone (``modules_to_not_convert``,
``ignore``) store a plain ``weight`` and stay ordinary linear layers, sized as stored like any other.

Supported (anything else is a :class:`PlanError` naming the field and what is supported):

- ``gptq``: ``bits`` 4 or 8, ``group_size`` -1 or a multiple of 64, ``desc_act`` with ``g_idx``, ``sym`` or not,
  ``checkpoint_format`` ``gptq`` (zero points stored minus one) or ``gptq_v2``;
- ``awq``: ``version`` ``gemm``, ``bits`` 4, ``group_size`` -1 or a multiple of 64, ``zero_point`` or not;
- ``compressed-tensors``: ``format`` ``pack-quantized`` (int4/int8), ``naive-quantized`` / ``int-quantized``
  (int8), ``float-quantized`` (FP8 e4m3, per channel or per tensor); weights strategy ``channel``, ``group``
  (a multiple of 64) or ``tensor``;
- ``fp8``: ``fmt`` e4m3, ``weight_block_size`` (``weight_scale_inv`` per block, as DeepSeek-V3 and Qwen3-FP8 ship);
- ``mxfp4``: e2m1 codes in blocks of 32 inputs with one e8m0 scale each, in the gpt-oss layout applied to linear
  layers: ``<module>.weight_blocks`` uint8 ``[N, K/32, 16]`` (two codes a byte, the even input in the low nibble)
  and ``<module>.weight_scales`` uint8 ``[N, K/32]``; ``in_features`` a multiple of 32. gpt-oss's own fused MoE
  experts (``experts.gate_up_proj_blocks``, ...) are not read yet: :mod:`planner.model.packed_linear` refuses
  MXFP4 blocks that belong to no linear layer;
- ``bitsandbytes`` saved already quantized with ``load_in_8bit``: ``weight`` int8 ``[N, K]`` and ``SCB`` float32
  ``[N]`` (each row's absmax, the scale ``SCB / 127``), as ``Linear8bitLt`` saves them;
- ``bitsandbytes`` saved already quantized with ``load_in_4bit``, ``bnb_4bit_quant_type`` ``nf4`` or ``fp4``,
  ``bnb_4bit_quant_storage`` ``uint8``, with or without ``bnb_4bit_use_double_quant``, as ``Linear4bit`` saves it:
  ``weight`` uint8 ``[ceil(N*K/2), 1]`` (two codes a byte, the first in the high nibble, over the row-major
  weight), ``weight.absmax`` (float32 per block, or uint8 codes with double quant), ``weight.quant_map`` float32
  ``[16]``, ``weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``: a JSON blob with the block size, the shape and,
  with double quant, the nested block size and offset), and with double quant ``weight.nested_absmax`` and
  ``weight.nested_quant_map`` float32 ``[256]``. The block size is not in ``config.json``: the plan checks that the
  stored ``absmax`` count fits one bitsandbytes allows (:data:`BNB_4BIT_BLOCKSIZES`), the loader reads it from the
  blob.

Not a torch import here: the planner's core reads this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.errors import PlanError

#: The ``quant_method`` values this module reads.
SUPPORTED_METHODS = (
    "gptq",
    "awq",
    "compressed-tensors",
    "fp8",
    "mxfp4",
    "bitsandbytes (load_in_8bit, load_in_4bit nf4/fp4)",
)
#: Known methods that loadmaster does not load yet (their checkpoints are refused with this said).
NOT_YET = ("hqq", "eetq", "quanto", "aqlm", "exl2", "torchao", "fbgemm_fp8", "bitnet")
#: Inputs per group of the native 4-bit layout: a format's group must be a whole number of them.
NATIVE_GROUP = 64
#: Inputs per MXFP4 block (one e8m0 scale byte and 16 bytes of e2m1 codes).
MXFP4_BLOCK = 32
#: The stored layouts of FP8 weights (compressed-tensors' float-quantized and block-wise ``fp8``) and of MXFP4.
FP8_LAYOUTS = ("ct-fp8", "fp8-block")
MXFP4_LAYOUT = "mxfp4"
#: The layouts of bitsandbytes 4-bit checkpoints, by ``bnb_4bit_quant_type``.
BNB_4BIT_LAYOUTS = {"nf4": "bnb-nf4", "fp4": "bnb-fp4"}
#: The block sizes bitsandbytes' ``quantize_4bit`` takes (its ``dequantize_4bit`` refuses any other).
BNB_4BIT_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: The stored tensors of a bitsandbytes 4-bit layer besides ``weight``, as suffixes of the layer's name.
BNB_4BIT_ABSMAX = "weight.absmax"
BNB_4BIT_STATE = "weight.quant_state.bitsandbytes__"


@dataclass(frozen=True)
class QuantFormat:
    """One checkpoint's quantization, as the loader repacks it.

    ``layout`` names the stored layout (``gptq``, ``awq``, ``ct-pack``, ``ct-int``, ``ct-fp8``, ``fp8-block``,
    ``mxfp4``, ``bnb-int8``, ``bnb-nf4``, ``bnb-fp4``);
    ``marker`` the tensor suffix whose presence makes a linear layer quantized; ``group_size`` is -1 per output
    channel, 0 per tensor, else inputs per group; ``block`` the FP8 ``[rows, cols]`` scale block;
    ``double_quant``: bitsandbytes 4-bit's absmax stored as 8-bit codes (as the config declares; the loader goes
    by the tensors each layer stores)."""

    method: str
    layout: str
    marker: str
    bits: int
    group_size: int = -1
    sym: bool = True
    desc_act: bool = False
    zeros_minus_one: bool = False
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()
    double_quant: bool = False

    @property
    def cpu_kernel(self) -> str:
        """The native kernel that runs this format's layers on the CPU and from disk (as
        :func:`loaders.native.packed_formats.repack` chooses it), or what they become where none does."""
        if self.layout in FP8_LAYOUTS:
            return "linear_fp8 (e4m3 bytes as stored)"
        if self.layout == MXFP4_LAYOUT:
            return "linear_mxfp4 (e2m1 blocks as stored)"
        if self.layout in BNB_4BIT_LAYOUTS.values():
            return "linear_nf4 (4-bit codes as stored, a 16-float table)"
        if self.bits == 4:
            return "linear_q4 (repacked int4)" if self.sym else "linear_q4z (repacked int4 + zero points)"
        if self.group_size in (-1, 0) and not self.desc_act:
            return "linear_q8 (repacked int8)"
        return "none: int8 in groups is dequantized to the compute dtype"

    @property
    def describe(self) -> str:
        group = {-1: "per channel", 0: "per tensor"}.get(self.group_size, f"group {self.group_size}")
        if self.block:
            group = f"blocks {self.block[0]}x{self.block[1]}"
        if self.layout == MXFP4_LAYOUT:
            return f"{self.method} e2m1 blocks of {MXFP4_BLOCK}"
        if self.layout in BNB_4BIT_LAYOUTS.values():
            return f"{self.method} {self.layout.removeprefix('bnb-')}{' double-quant' if self.double_quant else ''}"
        kind = "fp8" if self.layout in FP8_LAYOUTS else f"int{self.bits}"
        return f"{self.method} {kind} {group}{'' if self.sym else ' asymmetric'}{' act-order' if self.desc_act else ''}"


def _fail(field: str, value: Any, supported: str) -> PlanError:
    return PlanError(
        f"quantization_config.{field}={value!r} is not supported; supported: {supported}. "
        "Use a checkpoint in a supported layout, or the unquantized one with --cpu-quantization."
    )


def _group(cfg: Mapping[str, Any], field: str = "group_size") -> int:
    g = cfg.get(field, -1)
    g = -1 if g is None else int(g)
    if g != -1 and (g <= 0 or g % NATIVE_GROUP):
        raise _fail(field, g, f"-1 (per channel) or a multiple of {NATIVE_GROUP}")
    return g


def _gptq(cfg: Mapping[str, Any]) -> QuantFormat:
    bits = int(cfg.get("bits", 4))
    if bits not in (4, 8):
        raise _fail("bits", bits, "4 or 8")
    fmt = str(cfg.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail("checkpoint_format", fmt, "gptq or gptq_v2")
    return QuantFormat(
        "gptq",
        "gptq",
        "qweight",
        bits,
        _group(cfg),
        bool(cfg.get("sym", True)),
        bool(cfg.get("desc_act", False)),
        zeros_minus_one=fmt == "gptq",
        ignore=tuple(cfg.get("modules_to_not_convert") or ()),
    )


def _awq(cfg: Mapping[str, Any]) -> QuantFormat:
    version = str(cfg.get("version") or "gemm").lower()
    if version != "gemm":
        raise _fail("version", version, "gemm")
    bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
    if bits != 4:
        raise _fail("bits", bits, "4")
    group = _group(cfg, "group_size" if "group_size" in cfg else "q_group_size")
    return QuantFormat(
        "awq",
        "awq",
        "qweight",
        4,
        group,
        sym=not bool(cfg.get("zero_point", True)),
        ignore=tuple(cfg.get("modules_to_not_convert") or ()),
    )


def _ct_weights(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    groups = cfg.get("config_groups") or {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, Mapping) and g.get("weights")]
    if not weights:
        raise _fail("config_groups", None, "one config group with 'weights' quantization arguments")
    if any(w != weights[0] for w in weights[1:]):
        raise _fail("config_groups", "several different weight schemes", "one weight scheme for every group")
    return weights[0]


def _compressed_tensors(cfg: Mapping[str, Any]) -> QuantFormat:
    form = str(cfg.get("format") or "").lower()
    w = _ct_weights(cfg)
    bits, wtype = int(w.get("num_bits", 8)), str(w.get("type", "int")).lower()
    strategy = str(w.get("strategy") or "tensor").lower()
    if strategy not in ("channel", "group", "tensor"):
        raise _fail("config_groups.weights.strategy", strategy, "channel, group or tensor")
    group = {"channel": -1, "tensor": 0}.get(strategy)
    if group is None:
        group = _group(w)
        if group == -1:
            raise _fail("config_groups.weights.group_size", None, f"a multiple of {NATIVE_GROUP} for strategy group")
    sym, ignore = bool(w.get("symmetric", True)), tuple(cfg.get("ignore") or ())
    if w.get("actorder") not in (None, False, "static"):
        raise _fail("config_groups.weights.actorder", w.get("actorder"), "none or static")
    if form == "pack-quantized" and wtype == "int" and bits in (4, 8):
        return QuantFormat("compressed-tensors", "ct-pack", "weight_packed", bits, group, sym, ignore=ignore)
    if form in ("naive-quantized", "int-quantized") and wtype == "int" and bits == 8:
        return QuantFormat("compressed-tensors", "ct-int", "weight_scale", 8, group, sym, ignore=ignore)
    if form == "float-quantized" and wtype == "float" and bits == 8:
        return QuantFormat("compressed-tensors", "ct-fp8", "weight_scale", 8, group, True, ignore=ignore)
    raise _fail(
        "format",
        f"{form} ({wtype}{bits})",
        "pack-quantized (int4, int8), naive-quantized or int-quantized (int8), float-quantized (fp8)",
    )


def _fp8(cfg: Mapping[str, Any]) -> QuantFormat:
    fmt = str(cfg.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise _fail("fmt", fmt, "e4m3")
    block = cfg.get("weight_block_size")
    if block is None or len(block) != 2 or any(int(b) <= 0 for b in block):
        raise _fail("weight_block_size", block, "two positive block sides, e.g. [128, 128]")
    return QuantFormat(
        "fp8",
        "fp8-block",
        "weight_scale_inv",
        8,
        block=(int(block[0]), int(block[1])),
        ignore=tuple(cfg.get("modules_to_not_convert") or ()),
    )


def _mxfp4(cfg: Mapping[str, Any]) -> QuantFormat:
    block = cfg.get("block_size", cfg.get("group_size", MXFP4_BLOCK))  # not written by gpt-oss: 32 is the format's
    if block is None or int(block) != MXFP4_BLOCK:
        raise _fail("block_size", block, f"{MXFP4_BLOCK} (the MX format's block)")
    return QuantFormat(
        "mxfp4",
        "mxfp4",
        "weight_blocks",
        4,
        MXFP4_BLOCK,
        ignore=tuple(cfg.get("modules_to_not_convert") or ()),
    )


def _bitsandbytes(cfg: Mapping[str, Any]) -> QuantFormat:
    ignore = tuple(cfg.get("llm_int8_skip_modules") or ())
    if cfg.get("load_in_4bit"):
        return _bitsandbytes_4bit(cfg, ignore)
    if not cfg.get("load_in_8bit"):
        raise _fail(
            "load_in_8bit",
            cfg.get("load_in_8bit"),
            "load_in_8bit or load_in_4bit true (a checkpoint saved already quantized)",
        )
    return QuantFormat("bitsandbytes", "bnb-int8", "SCB", 8, -1, ignore=ignore)


def _bitsandbytes_4bit(cfg: Mapping[str, Any], ignore: tuple[str, ...]) -> QuantFormat:
    """``load_in_4bit``: nf4 or fp4 codes in bytes (transformers' default type is fp4, its default storage uint8)."""
    quant_type = str(cfg.get("bnb_4bit_quant_type") or "fp4").lower()
    if quant_type not in BNB_4BIT_LAYOUTS:
        raise _fail("bnb_4bit_quant_type", quant_type, "nf4 or fp4")
    storage = str(cfg.get("bnb_4bit_quant_storage") or "uint8").lower().removeprefix("torch.")
    if storage != "uint8":
        raise _fail("bnb_4bit_quant_storage", storage, "uint8 (two 4-bit codes a byte)")
    return QuantFormat(
        "bitsandbytes",
        BNB_4BIT_LAYOUTS[quant_type],
        BNB_4BIT_ABSMAX,
        4,
        -1,
        ignore=ignore,
        double_quant=bool(cfg.get("bnb_4bit_use_double_quant", False)),
    )


_READERS = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
    "mxfp4": _mxfp4,
    "bitsandbytes": _bitsandbytes,
}


def quant_format(doc: Mapping[str, Any]) -> QuantFormat | None:
    """The checkpoint quantization ``config.json`` declares (None: none), or a :class:`PlanError` naming the
    field that is not supported and what is."""
    cfg = doc.get("quantization_config")
    if cfg is None and isinstance(doc.get("text_config"), Mapping):
        cfg = doc["text_config"].get("quantization_config")
    if not cfg:
        return None
    if not isinstance(cfg, Mapping):
        raise _fail("", type(cfg).__name__, "a JSON object")
    method = str(cfg.get("quant_method") or "").lower()
    reader = _READERS.get(method)
    if reader is None:
        later = " (known, not loaded by loadmaster yet)" if method in NOT_YET else ""
        raise _fail("quant_method", method + later if later else method, ", ".join(SUPPORTED_METHODS))
    return reader(cfg)


def expected_shapes(fmt: QuantFormat, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
    """The stored shape of each main tensor of one quantized ``[out, in]`` linear layer, by suffix (what the
    headers must agree with; scales of the float formats whose shape varies are left out)."""
    n, k = out_features, in_features
    groups = 1 if fmt.group_size in (-1, 0) else -(-k // fmt.group_size)
    per_int = 32 // fmt.bits
    if fmt.layout == "gptq":
        return {
            "qweight": (-(-k // per_int), n),
            "qzeros": (groups, -(-n // per_int)),
            "scales": (groups, n),
        }
    if fmt.layout == "awq":
        return {"qweight": (k, -(-n // 8)), "qzeros": (groups, -(-n // 8)), "scales": (groups, n)}
    if fmt.layout == "ct-pack":
        return {"weight_packed": (n, -(-k * fmt.bits // 32))}
    if fmt.layout in ("ct-int", "ct-fp8"):
        return {"weight": (n, k)}
    if fmt.layout == "bnb-int8":
        return {"weight": (n, k), "SCB": (n,)}
    if fmt.layout in BNB_4BIT_LAYOUTS.values():
        return {"weight": (-(-n * k // 2), 1), "weight.quant_map": (16,), "weight.nested_quant_map": (256,)}
    if fmt.layout == "mxfp4":
        nb = k // MXFP4_BLOCK
        return {"weight_blocks": (n, nb, MXFP4_BLOCK // 2), "weight_scales": (n, nb)}
    assert fmt.block is not None
    return {"weight": (n, k), "weight_scale_inv": (-(-n // fmt.block[0]), -(-k // fmt.block[1]))}


def check_stored_shapes(fmt: QuantFormat, module: str, out_features: int, in_features: int, stored) -> None:
    """A :class:`PlanError` when a packed tensor's stored shape disagrees with the config's layer."""
    if fmt.layout == "mxfp4" and in_features % MXFP4_BLOCK:
        raise PlanError(
            f"{module}.weight_blocks: the layer has in_features={in_features}, not a multiple of {MXFP4_BLOCK}, so it "
            f"cannot hold whole MXFP4 blocks of {MXFP4_BLOCK}: the checkpoint disagrees with config.json."
        )
    if fmt.layout in BNB_4BIT_LAYOUTS.values():
        _check_bnb_4bit(fmt, module, out_features * in_features, stored)
    for suffix, shape in expected_shapes(fmt, out_features, in_features).items():
        got = stored.get(suffix)
        if got is not None and tuple(got) != shape:
            raise PlanError(
                f"{module}.{suffix} is stored as {list(got)}, but a {fmt.describe} layer of {out_features} outputs "
                f"and {in_features} inputs stores {list(shape)}: the checkpoint disagrees with its "
                "quantization_config or config.json."
            )


def _check_bnb_4bit(fmt: QuantFormat, module: str, numel: int, stored) -> None:
    """What a bitsandbytes 4-bit layer must store beyond fixed shapes: its quant state blob of the config's type
    (it holds the block size, and the offset of double quant), an ``absmax`` count of a block size bitsandbytes
    allows, and the nested pair of double quant together."""
    quant_type = fmt.layout.removeprefix("bnb-")
    want = BNB_4BIT_STATE + quant_type
    others = sorted(s for s in stored if s.startswith(BNB_4BIT_STATE) and s != want)
    if others:
        raise PlanError(
            f"{module}.{others[0]} is stored, but quantization_config.bnb_4bit_quant_type is {quant_type!r}: the "
            "checkpoint disagrees with its config.json; set bnb_4bit_quant_type to the stored type."
        )
    for suffix in ("weight", "weight.quant_map", want):
        if suffix not in stored:
            raise PlanError(
                f"{module}.{suffix} is missing: a bitsandbytes 4-bit layer stores its codes (weight), their table "
                "(weight.quant_map) and its quant state (block size, shape) as Linear4bit saves them. Re-save the "
                "checkpoint with transformers' save_pretrained."
            )
    absmax = tuple(stored[BNB_4BIT_ABSMAX])
    blocks = [b for b in BNB_4BIT_BLOCKSIZES if absmax == (-(-numel // b),)]
    if not blocks:
        raise PlanError(
            f"{module}.{BNB_4BIT_ABSMAX} is stored as {list(absmax)}, but a layer of {numel} weights in blocks of "
            f"any of {', '.join(map(str, BNB_4BIT_BLOCKSIZES))} stores one absmax a block: the checkpoint "
            "disagrees with config.json."
        )
    nested = [s in stored for s in ("weight.nested_absmax", "weight.nested_quant_map")]
    if any(nested) and not all(nested):
        raise PlanError(
            f"{module}: double quant stores weight.nested_absmax and weight.nested_quant_map together; this layer "
            "stores one of them. Re-save the checkpoint with transformers' save_pretrained."
        )
