"""Small pre-quantized checkpoints written from a test Llama, in each format's published layout.

Round-to-nearest quantization (not GPTQ's or AWQ's search: the layout is what is tested), packed as each format
stores it: GPTQ and AWQ by this module, following their documented packing; compressed-tensors through the
``compressed-tensors`` package's own ``pack_to_int32`` where it installs; MXFP4 in the gpt-oss layout applied to
linear layers (``weight_blocks`` / ``weight_scales``), or, for a gpt-oss model, on its routed experts alone as
gpt-oss ships them (``experts.gate_up_proj_blocks`` / ``_scales``, ...), its reference weights dequantized by
transformers' own MXFP4 dequantizer (``convert_moe_packed_tensors``); bitsandbytes ``load_in_8bit`` quantized and dequantized by
bitsandbytes' own ``int8_vectorwise_quant`` / ``int8_vectorwise_dequant`` (its CPU backend), saved under the keys
``Linear8bitLt`` writes (``weight``, ``SCB``, ``weight_format``); bitsandbytes ``load_in_4bit`` (nf4, fp4, double
quant or not) quantized by its ``quantize_4bit`` and saved under the keys ``Linear4bit`` writes (``weight`` and
``QuantState.as_dict(packed=True)`` under ``weight.``), its reference dequantized by its ``dequantize_4bit``.
:func:`write_quantized` returns the
folder and the dequantized float32 weights, which a reference model loads to give the logits a load must match.
The output head stays unquantized (``modules_to_not_convert`` / ``ignore``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from planner.model.packed_experts import PROJECTIONS

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    r, c = codes.shape
    padded = torch.zeros((-(-r // per) * per, c), dtype=torch.int64)
    padded[:r] = codes.to(torch.int64)
    v = padded.view(-1, per, c)
    return _int32(sum(v[:, i] << (bits * i) for i in range(per)))


def _groups_of(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    """g_idx: each input's group; with act-order, groups are taken over a fixed random order of the inputs."""
    if not act_order:
        return torch.arange(k) // group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group
    return g_idx


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """Per output row and group: (codes [N, K], scales [N, G] float16, zeros [N, G] int), GPTQ's grid."""
    n, _ = w.shape
    maxq = 2**bits - 1
    scales = torch.empty((n, groups), dtype=torch.float16)
    zeros = torch.empty((n, groups), dtype=torch.int64)
    codes = torch.empty(w.shape, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-8).to(torch.float16)
        z = torch.full((n,), (maxq + 1) // 2) if sym else torch.round(-lo / s.float()).clamp(0, maxq).long()
        q = torch.round(wg / s.float()[:, None]) + z[:, None]
        codes[:, cols] = q.clamp(0, maxq).long()
        scales[:, g], zeros[:, g] = s, z
    return codes, scales, zeros


def _gptq_layer(w, bits, group, sym, act_order, seed, v2=False):
    n, k = w.shape
    group = k if group == -1 else group
    g_idx = _groups_of(k, group, act_order, seed)
    groups = -(-k // group)
    codes, scales, zeros = _rtn(w, g_idx, groups, bits, sym)
    deq = (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
    stored_z = zeros if v2 else (zeros - 1) % (2**bits)
    tensors = {
        "qweight": pack_rows(codes.t(), bits),
        "qzeros": pack_rows(stored_z, bits).t().contiguous(),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, deq


def _awq_layer(w, group, zero_point):
    n, k = w.shape
    group = k if group == -1 else group
    g_idx = torch.arange(k) // group
    groups = -(-k // group)
    codes, scales, zeros = _rtn(w, g_idx, groups, 4, not zero_point)
    deq = (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]

    def pack_awq(t):  # t: [R, N] codes -> [R, N/8] int32, nibble i holding column 8c + AWQ_ORDER[i]
        r, c = t.shape
        v = t.view(r, c // 8, 8)[:, :, list(AWQ_ORDER)].to(torch.int64)
        return _int32(sum(v[:, :, i] << (4 * i) for i in range(8)))

    return {"qweight": pack_awq(codes.t()), "qzeros": pack_awq(zeros.t()), "scales": scales.t().contiguous()}, deq


def _ct_int_layer(w, bits, group, sym, packed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = w.shape
    g = k if group == -1 else group
    wg = w.view(n, -1, g)
    qmax, qmin = 2 ** (bits - 1) - 1, -(2 ** (bits - 1))
    if sym:
        s = (wg.abs().amax(-1) / ((qmax - qmin) / 2)).clamp(min=1e-8).to(torch.bfloat16)
        zp = torch.zeros_like(s, dtype=torch.int8)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / (qmax - qmin)).clamp(min=1e-8).to(torch.bfloat16)
        zp = torch.round(qmin - lo / s.float()).clamp(qmin, qmax).to(torch.int8)
    q = torch.round(wg / s.float()[..., None] + zp[..., None]).clamp(qmin, qmax).to(torch.int8)
    deq = ((q.float() - zp.float()[..., None]) * s.float()[..., None]).reshape(n, k)
    q = q.reshape(n, k)
    t = {"weight_scale": s}
    if packed:
        t["weight_packed"] = pack_to_int32(q, bits)
        t["weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not sym:
            t["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
    else:
        t["weight"] = q
        if not sym:
            t["weight_zero_point"] = zp
    return t, deq


def _fp8_layer(w, block):
    n, k = w.shape
    if block is None:  # compressed-tensors float-quantized, per channel
        s = (w.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
        q = (w / s).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s.to(torch.bfloat16)}, q.float() * s.to(torch.bfloat16).float()
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    s = torch.empty((gn, gk), dtype=torch.float32)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s[i, j] = (blk.abs().amax() / 448.0).clamp(min=1e-12)
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return {"weight": q, "weight_scale_inv": s}, q.float() * full


#: The e2m1 magnitudes of codes 0..7 (codes 8..15 are their negatives).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` as MXFP4 ``(blocks uint8 [N, K/32, 16], scales uint8 [N, K/32])``: per block of 32 the
    smallest power-of-two scale that puts its largest magnitude within 6, each value rounded to the nearest e2m1."""
    n, k = w.shape
    wb = w.float().reshape(n, k // 32, 32)
    amax = wb.abs().amax(-1).clamp(min=2.0**-100)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-126, 127)
    v = wb / torch.exp2(e)[..., None]
    mag = (v.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest magnitude's code, 0..7
    codes = (mag + 8 * (v < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (e + 127).to(torch.uint8)


def mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight transformers' MXFP4 dequantizer gives (it takes gpt-oss's expert tensors,
    ``[E, N, K/32, 16]``, and returns them transposed: one expert here, transposed back)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t().contiguous()


def _mxfp4_layer(w):
    blocks, scales = mxfp4_quantize(w)
    return {"weight_blocks": blocks, "weight_scales": scales}, mxfp4_reference(blocks, scales)


#: What gpt-oss's own config leaves unquantized: everything but the routed experts.
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _mxfp4_experts(t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A gpt-oss experts parameter ``[E, K, N]`` as gpt-oss stores it: ``_blocks [E, N, K/32, 16]`` and ``_scales
    [E, N, K/32]`` (each expert's ``[N, K]`` weight in the MXFP4 linear layout), and the float32 parameter
    transformers' own dequantizer (``convert_moe_packed_tensors``) makes of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    pairs = [mxfp4_quantize(t[e].t().float()) for e in range(t.shape[0])]
    blocks = torch.stack([b for b, _ in pairs])
    scales = torch.stack([s for _, s in pairs])
    return {"blocks": blocks, "scales": scales}, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def _bnb_int8_layer(w):
    from bitsandbytes.functional import int8_vectorwise_dequant, int8_vectorwise_quant

    cb, scb, _ = int8_vectorwise_quant(w.float())
    t = {"weight": cb, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}
    return t, int8_vectorwise_dequant(cb, scb).float()


def bnb_4bit_tensors(w: torch.Tensor, quant_type: str, double_quant: bool, blocksize: int = 64):
    """``w`` quantized by bitsandbytes' ``quantize_4bit``, as ``Linear4bit`` saves it: ``{suffix: tensor}`` with
    ``weight`` and the packed quant state under ``weight.``; and bitsandbytes' own float32 dequantization
    (:func:`bnb_4bit_dequantized`)."""
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(
        w.float(), blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
    )
    t = {"weight": packed}
    t.update({f"weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    return t, bnb_4bit_dequantized(packed, state)


def bnb_4bit_dequantized(packed: torch.Tensor, state) -> torch.Tensor:
    """A bitsandbytes 4-bit weight decoded to float32 by bitsandbytes' own reference code: ``dequantize_4bit``'s steps
    (the nested absmax decoded by its ``dequantize_blockwise``, plus the offset), then the torch implementation its
    CPU backend falls back to and says matches its C++ and CUDA kernels, run eagerly.

    Why not ``dequantize_4bit`` itself: on a CPU with AVX-512, bitsandbytes 0.50's CPU kernel decodes some shapes
    wrongly. A 96x160 nf4 weight in blocks of 64 came back 0.09 off the weights on a Zen 4, where the code table
    times each block's absmax is 0.025 off (the quantization error), wrong from the fourth block on; on AVX2 the
    kernel and this agree bit for bit."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.functional import dequantize_blockwise

    absmax = state.absmax
    if state.nested:
        absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
    eager = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)  # not torch.compile's
    flat = packed.reshape(-1).view(torch.uint8)
    return eager(flat, absmax.float(), state.code.float(), state.blocksize, state.shape, torch.float32)


def _quant_config(fmt: str, **o) -> dict:
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": o["bits"],
            "group_size": o["group"],
            "desc_act": o["act_order"],
            "sym": o["sym"],
            "checkpoint_format": "gptq_v2" if o.get("v2") else "gptq",
        }
    if fmt == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": o["group"], "zero_point": True}
    if fmt == "bnb-int8":
        return {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False, "llm_int8_threshold": 6.0}
    if fmt == "bnb-4bit":
        return {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_4bit_quant_type": o["quant_type"],
            "bnb_4bit_use_double_quant": o["double_quant"],
            "bnb_4bit_compute_dtype": "float32",
            "bnb_4bit_quant_storage": "uint8",
        }
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    strategy = "channel" if o.get("group", -1) == -1 else "group"
    wtype, bits = ("float", 8) if fmt == "ct-fp8" else ("int", o["bits"])
    weights = {"num_bits": bits, "type": wtype, "symmetric": o.get("sym", True), "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = o["group"]
    form = {"ct-pack": "pack-quantized", "ct-int": "naive-quantized", "ct-fp8": "float-quantized"}[fmt]
    return {
        "quant_method": "compressed-tensors",
        "format": form,
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def write_quantized(source: Path, dest: Path, fmt: str, **o) -> dict[str, torch.Tensor]:
    """Write ``source`` (a saved Llama) to ``dest`` as ``fmt`` (``gptq``, ``awq``, ``ct-pack``, ``ct-int``,
    ``ct-fp8``, ``fp8``, ``mxfp4``, ``bnb-int8``, ``bnb-4bit``) with options ``o``; returns the dequantized float32
    state dict (the reference)."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        state.update(load_file(f))
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    config = json.loads((source / "config.json").read_text())
    experts_only = config.get("model_type") == "gpt_oss"  # gpt-oss quantizes its routed experts alone
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        if fmt == "mxfp4" and experts_only and leaf in PROJECTIONS and mod.endswith(".experts"):
            packed, ref[key] = _mxfp4_experts(t)
            out.update({f"{key}_{part}": v.contiguous() for part, v in packed.items()})
            continue
        if leaf != "weight" or mod.rpartition(".")[2] not in LINEARS or experts_only:
            out[key] = t
            ref[key] = t.float()
            continue
        w = t.float()
        if fmt == "gptq":
            packed, deq = _gptq_layer(w, o["bits"], o["group"], o["sym"], o["act_order"], len(out), o.get("v2"))
        elif fmt == "awq":
            packed, deq = _awq_layer(w, o["group"], True)
        elif fmt == "mxfp4":
            packed, deq = _mxfp4_layer(w)
        elif fmt == "bnb-int8":
            packed, deq = _bnb_int8_layer(w)
        elif fmt == "bnb-4bit":
            packed, deq = bnb_4bit_tensors(w, o["quant_type"], o["double_quant"])
        elif fmt in ("ct-pack", "ct-int"):
            packed, deq = _ct_int_layer(w, o["bits"], o.get("group", -1), o.get("sym", True), fmt == "ct-pack")
        else:
            packed, deq = _fp8_layer(w, (128, 128) if fmt == "fp8" else None)
        for suffix, v in packed.items():
            out[f"{mod}.{suffix}"] = v.contiguous()
        ref[key] = deq
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json", "config.json"):
            shutil.copy(f, dest / f.name)
    config["quantization_config"] = _quant_config(fmt, **o)
    if experts_only:
        config["quantization_config"]["modules_to_not_convert"] = GPT_OSS_NOT_CONVERTED
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    return ref
