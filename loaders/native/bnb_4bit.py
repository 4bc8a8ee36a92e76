"""bitsandbytes 4-bit layers (nf4, fp4) as ``Linear4bit`` saves them: kept as stored for the native kernel, or
decoded to float32 in plain torch.

nf4's 16 values are not integers times a power of two (MXFP4's e2m1 values are, which is what lets
``linear_mxfp4`` sum in integers), so the int4 kernels cannot take their codes. :class:`Bnb4CPULinear` keeps the
stored codes (on a disk tier a map of the shard) and float32 absmax, and multiplies with ``loadmaster::linear_nf4``
(``kernels/linear_nf4.c``: a 16-float table lookup, float32 sums, no activation rounding). Decode rows run on it;
bf16 prompts run torch's GEMM on tiles dequantized by :func:`loaders.native.operators.dequantize_nf4`. A layer the
kernel cannot take (a block that straddles rows: ``in_features`` not a multiple of the block size), and every layer
on a GPU, is dequantized once at load by :func:`dequantize_bnb_4bit` (:mod:`loaders.native.packed_formats`), and
the log says so. Decoding is our own code, not bitsandbytes', so a load needs no bitsandbytes.

The stored form (bitsandbytes 0.50, ``QuantState.as_dict(packed=True)``; see :mod:`planner.model.quant_config`):
the weight ``[N, K]`` flattened row-major, two codes a byte with the first in the high nibble; one ``absmax`` per
block of ``blocksize`` codes (the last block may be short); the weight is ``quant_map[code] * absmax[block]``,
one float32 product, as bitsandbytes' ``dequantize_4bit`` computes it, so the two agree bit for bit (tested).
With double quant, ``absmax`` holds 8-bit codes and each absmax is ``nested_quant_map[code] *
nested_absmax[j // nested_blocksize] + offset`` (``QuantState``'s ``state2`` and ``offset``). The block sizes and
the offset live in the JSON blob ``weight.quant_state.bitsandbytes__<type>``, read with :func:`json.loads`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from torch import nn

from loaders.errors import CheckpointError
from loaders.native import operators
from planner.model.packed_linear import PackedLinear
from planner.model.quant_config import BNB_4BIT_BLOCKSIZES, BNB_4BIT_STATE


@dataclass(frozen=True)
class Bnb4State:
    """The non-tensor quant state of one layer, from its JSON blob."""

    quant_type: str
    blocksize: int
    shape: tuple[int, ...]
    nested_blocksize: int | None = None
    nested_offset: float | None = None


def read_quant_state(blob: torch.Tensor, where: str) -> Bnb4State:
    """The quant state stored as uint8 JSON bytes in ``blob`` (the tensor ``where``, named in errors)."""
    try:
        doc = json.loads(bytes(blob.to(torch.uint8).flatten().tolist()).decode("utf-8"))
        nested = "nested_blocksize" in doc
        return Bnb4State(
            str(doc["quant_type"]),
            int(doc["blocksize"]),
            tuple(int(d) for d in doc["shape"]),
            int(doc["nested_blocksize"]) if nested else None,
            float(doc["nested_offset"]) if nested else None,
        )
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{where}: not a bitsandbytes quant state ({e}); it should be JSON with quant_type, blocksize and shape, "
            "as Linear4bit saves it. Re-save the checkpoint with transformers' save_pretrained."
        ) from e


def dequantize_blocks(codes: torch.Tensor, table: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``table[codes]`` times each block's ``absmax`` (float32, flat): blocks of ``blocksize`` codes, the last one
    possibly short."""
    return _scaled_blocks(table.to(torch.float32)[codes.reshape(-1).to(torch.int64)], absmax, blocksize)


def dequantize_nibbles(
    packed: torch.Tensor, quant_map: torch.Tensor, absmax: torch.Tensor, blocksize: int, n: int
) -> torch.Tensor:
    """The first ``n`` values of 4-bit codes packed two a byte (high nibble first), float32 and flat
    (:func:`loaders.native.operators.nibble_values`, then each block's absmax)."""
    return _scaled_blocks(operators.nibble_values(packed, quant_map)[:n], absmax, blocksize)


def _scaled_blocks(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Flat float32 ``values`` times each block's ``absmax``, one float32 product: blocks of ``blocksize``, the last
    one possibly short."""
    n, blocks = values.numel(), absmax.numel()
    padded = torch.nn.functional.pad(values, (0, blocks * blocksize - n)) if blocks * blocksize != n else values
    return (padded.view(blocks, blocksize) * absmax.to(torch.float32).view(-1, 1)).reshape(-1)[:n]


def _absmax(m: PackedLinear, state: Bnb4State, blocks: int, where: str) -> torch.Tensor:
    """Each block's absmax in float32: as stored, or decoded from double quant's 8-bit codes."""
    absmax = m.stored("weight.absmax")
    if absmax is None or absmax.numel() != blocks:
        got = None if absmax is None else absmax.numel()
        raise CheckpointError(
            f"{where}.weight.absmax holds {got} values, but blocksize={state.blocksize} over {math.prod(state.shape)} "
            f"weights needs {blocks}: the quant state and the tensors disagree. Re-save the checkpoint."
        )
    nested = m.stored("weight.nested_absmax")
    if nested is None:
        return absmax.to(torch.float32)
    nb = state.nested_blocksize
    if nb is None or nb <= 0 or state.nested_offset is None or -(-blocks // nb) != nested.numel():
        raise CheckpointError(
            f"{where}.weight.nested_absmax: double quant needs nested_blocksize and nested_offset in the quant state "
            f"and one nested absmax per nested block (got nested_blocksize={nb}, {nested.numel()} values for "
            f"{blocks} codes). Re-save the checkpoint."
        )
    table = m.stored("weight.nested_quant_map")
    assert table is not None  # the plan refuses one of the nested pair without the other
    return dequantize_blocks(absmax, table, nested, nb) + torch.tensor(state.nested_offset, dtype=torch.float32)


def _checked_state(m: PackedLinear, where: str) -> tuple[Bnb4State, torch.Tensor]:
    """A stored layer's quant state, checked against the layer, and its absmax as float32 (flat, one a block)."""
    quant_type = m.fmt.layout.removeprefix("bnb-")
    blob = m.stored(BNB_4BIT_STATE + quant_type)
    if blob is None:  # the plan refuses such a layer; a layer built some other way may still lack it
        raise CheckpointError(f"{where}.{BNB_4BIT_STATE}{quant_type} is missing: re-save the checkpoint.")
    state = read_quant_state(blob, f"{where}.{BNB_4BIT_STATE}{quant_type}")
    n, k = m.out_features, m.in_features
    if state.quant_type != quant_type or state.shape != (n, k) or state.blocksize not in BNB_4BIT_BLOCKSIZES:
        raise CheckpointError(
            f"{where}: the quant state says quant_type={state.quant_type!r}, shape={list(state.shape)}, "
            f"blocksize={state.blocksize}; the layer is {quant_type} [{n}, {k}] and bitsandbytes' block sizes are "
            f"{', '.join(map(str, BNB_4BIT_BLOCKSIZES))}. Re-save the checkpoint."
        )
    return state, _absmax(m, state, -(-n * k // state.blocksize), where)


def dequantize_bnb_4bit(m: PackedLinear, where: str = "a bitsandbytes 4-bit layer") -> torch.Tensor:
    """The float32 weight ``[N, K]`` of a stored bitsandbytes 4-bit layer (``where`` names it in errors)."""
    state, absmax = _checked_state(m, where)
    n, k = m.out_features, m.in_features
    quant_map = m.stored("weight.quant_map")
    assert quant_map is not None  # the plan checks its stored shape, [16]
    return dequantize_nibbles(m.weight, quant_map, absmax, state.blocksize, n * k).view(n, k)


class Bnb4CPULinear(nn.Module):
    """A bitsandbytes 4-bit linear layer holding its stored codes, float32 absmax per block and 16-value table
    (see the module docstring)."""

    def __init__(
        self,
        quant_type: str,
        codes: torch.Tensor,
        absmax: torch.Tensor,
        table: torch.Tensor,
        bias: torch.Tensor | None,
    ):
        super().__init__()
        self.quant_type = quant_type
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        self.blocksize = self.in_features // absmax.shape[1]
        self.register_buffer("codes", codes)
        self.register_buffer("absmax", absmax)
        self.register_buffer("table", table)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_packed(cls, m: PackedLinear, where: str = "a bitsandbytes 4-bit layer") -> Bnb4CPULinear | None:
        """The layer for a stored one, its codes and (without double quant) absmax as they are; None where a block
        straddles two rows (``in_features`` not a multiple of the block size), which the kernel does not take."""
        state, absmax = _checked_state(m, where)
        n, k = m.out_features, m.in_features
        if k % state.blocksize or state.blocksize % 16:
            return None
        quant_map = m.stored("weight.quant_map")
        assert quant_map is not None  # the plan checks its stored shape, [16]
        codes = m.weight.reshape(n, k // 2)
        bias = m.bias.detach() if m.bias is not None else None
        table = quant_map.to(torch.float32).contiguous()
        return cls(m.fmt.layout.removeprefix("bnb-"), codes, absmax.view(n, k // state.blocksize), table, bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return operators.dequantize_nf4(self.codes, self.absmax, self.table, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        if input.dtype is torch.bfloat16 and input.dim() >= 3 and input.shape[-2] > 1:  # a prompt
            return operators.linear_nf4_torch(input, self.codes, self.absmax, self.table, self.bias)
        return operators.linear_nf4(input, self.codes, self.absmax, self.table, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bitsandbytes {self.quant_type}, "
            f"float32 absmax per {self.blocksize}"
        )
