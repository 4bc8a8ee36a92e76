"""A decode step of a Llama-family model run on the native CPU kernels, without transformers' module code.

Why: at a decode step a layer's linear products are memory-bound kernel calls, and everything around them (two
RMSNorms, rotary embedding, the KV cache's write, the attention call, the MLP's activation, residual adds, and the
module calls and dispatch of each) ran as ~40 torch operators and Python calls per layer. On the 22-layer 1B Llama
that was ~9 ms of a 40 ms int8 step (measured by stubbing the products out), a fifth of the step; llama.cpp's whole
step is ~33 ms. :class:`NativeDecoder` runs the same arithmetic as a short list of native calls per layer:

    norm(h) -> q, k, v -> rotary + cache write -> attention -> o -> h += o, norm(h) -> gate, up -> silu * up
    -> down -> (h += down at the next layer's norm)

on preallocated buffers (:data:`MAX_ROWS` decode rows), the products on the same kernels the modules use
(``loaders.native.linear``'s float kernels, ``loaders.native.quantization``'s int8 and 4-bit ones, the FP8 one of
``loaders.native.fp8_linear``, the MXFP4 one of ``loaders.native.mxfp4_linear``, the bitsandbytes nf4/fp4 one of
``loaders.native.bnb_4bit``, q/k/v and gate/up in one
call each where the float kernel takes them together), the element-wise steps in ``kernels/decoder_ops.c``, which
rounds as the modules do in torch (see there).

It takes decode rows only (one new token per sequence, its KV written into the engine's slot cache at its position),
for the models whose layers it knows to be Llama-shaped (:data:`LLAMA_LAYERS`) with every weight on the CPU and on a
native kernel, full attention and a position-independent rotary embedding. :meth:`NativeDecoder.for_model` says why
not otherwise, and the caller runs the model's own forward. Prompts always run the model's forward; both write the
same cache, which holds each layer's keys and values as ``[slots, kv_heads, capacity, head_dim]``.

Each row's result depends on that row alone, as on the module path, so batched decode equals sequential decode.
Forward pre-hooks (disk readahead) on a layer or its parts are called when the step reaches that layer.

Each call runs on as many threads as its work pays for (:func:`team`), up to torch's count: a parallel region costs
its fork and barrier whatever it does, and on a small model every call of a step is small. Where libgomp stops
spinning between regions (two threads of the process start them: a program that loaded on one thread and decodes on
another, as ``bench.speculate`` does) a region costs ~11 us; there the 4-layer demo model (192 hidden, ~45 calls a
step of a few microseconds' work each) decoded 530 tok/s on two threads, 1,419 on one and 1,632 with teams sized by
work. The server, where one thread starts regions, ran it at the same speed either way. The count never changes a
result: every kernel here splits its work by output rows or (row, head) tasks, never a sum.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loaders.native import kernel_build
from loaders.native.bnb_4bit import Bnb4CPULinear
from loaders.native.fp8_linear import Fp8CPULinear
from loaders.native.linear import NativeCPULinear
from loaders.native.mxfp4_linear import Mxfp4CPULinear
from loaders.native.quantization import QuantizedCPULinear
from planner.model.decode_path import NATIVE_DECODE_LAYERS

log = logging.getLogger(__name__)

#: Decoder-layer classes whose forward is Llama's (the planner's table, which its cost model reads too).
LLAMA_LAYERS = tuple(NATIVE_DECODE_LAYERS.values())
#: Their RMSNorm classes (``weight * (x * rsqrt(mean(x^2) + eps))``, rounded to the dtype before the weight).
LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
#: Rotary types whose cos/sin at a position do not depend on the sequence length (so a table serves every step).
FIXED_ROPE_TYPES = ("default", "linear", "llama3")
#: Rows one step takes: the float kernels' row limit (``kernel_build.KERNELS``). Bigger decode batches run the model.
MAX_ROWS = 32
#: Bytes a kernel call reads or writes per thread it runs on (:func:`team`). Below this a second thread costs more
#: to wake and join than it saves: on 2 cores of an AMD EPYC a 192x512 fp32 product (393 KB) took 20 us on one
#: thread and 26 on two, a 1024x1024 one (4 MB) 126 and 50.
MIN_BYTES_PER_THREAD = 512 * 1024


def team(threads: int, work_bytes: int) -> int:
    """Threads for a kernel call touching ``work_bytes``: one per :data:`MIN_BYTES_PER_THREAD`, at least one, at
    most ``threads`` (torch's count, which the CPU share and the thread governor set)."""
    return max(1, min(threads, work_bytes // MIN_BYTES_PER_THREAD))


_DTYPES = (torch.float32, torch.bfloat16)
_ON = ("1", "true", "on", "yes", "")
_OFF = ("0", "false", "off", "no")


class NotNativeDecodable(Exception):
    """Why a model's decode steps cannot run on :class:`NativeDecoder` (the caller runs the model's forward)."""


@dataclass
class _Product:
    """One linear layer as a bound kernel call: ``out[:m] = x[:m] @ W^T (+ b)`` on the step's buffers."""

    call: Callable[[int, int], None]  # (rows, threads)
    nbytes: int  # the weights' bytes (scales, zero points and bias included): what one row's product reads

    def run(self, rows: int, threads: int) -> None:
        """The product for ``rows`` rows, on the threads its work pays for: the weight read, plus an eighth of it
        per extra row (its arithmetic; a row costs far less than the weights' read on these kernels)."""
        self.call(rows, team(threads, self.nbytes * (7 + rows) // 8))


@dataclass
class _Layer:
    """What one decoder layer's step needs: its norms, products, cache index, and the modules whose pre-hooks run."""

    index: int  # the cache layer index (``self_attn.layer_idx``)
    input_norm: tuple[int, float]  # weight pointer, eps
    post_norm: tuple[int, float]
    head_norms: tuple[tuple[int, float], tuple[int, float]] | None  # Qwen3's q_norm and k_norm, per head
    qkv: list[_Product]
    o: _Product
    gate_up: list[_Product]
    down: _Product
    scale: float
    module: nn.Module  # the decoder layer (its pre-hooks and its parts' run when the step reaches it)


def _rms(norm: nn.Module, dtype: torch.dtype) -> tuple[int, float]:
    if type(norm).__name__ not in LLAMA_NORMS:
        raise NotNativeDecodable(f"{type(norm).__name__} is not a Llama RMSNorm")
    w = norm.weight
    if w.dtype is not dtype or not w.is_cpu or not w.is_contiguous():
        raise NotNativeDecodable(f"a norm weight is {w.dtype} on {w.device}, not contiguous {dtype} on the CPU")
    return w.data_ptr(), float(norm.variance_epsilon)


@dataclass(frozen=True)
class _Geometry:
    """The sizes the step's buffers and kernel calls are cut to, read off the model's config and first layer."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @property
    def bf16(self) -> int:
        """The kernels' dtype flag."""
        return int(self.dtype is torch.bfloat16)


@dataclass(frozen=True)
class _StepBuffers:
    """The step's activations, preallocated for :data:`MAX_ROWS` rows: every kernel call is bound to their
    pointers once, when the decoder is made, so a step allocates nothing but its logits' copy."""

    h: torch.Tensor  # the residual stream
    x: torch.Tensor  # a norm's output: the products' input
    delta: torch.Tensor  # attention's and the MLP's output, added to ``h`` at the next norm
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    act: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def allocate(cls, g: _Geometry) -> _StepBuffers:
        r, d = MAX_ROWS, g.dtype
        qd, kvd = g.heads * g.head_dim, g.kv_heads * g.head_dim
        return cls(
            h=torch.zeros(r, g.hidden, dtype=d),
            x=torch.zeros(r, g.hidden, dtype=d),
            delta=torch.zeros(r, g.hidden, dtype=d),
            q=torch.zeros(r, qd, dtype=d),
            k=torch.zeros(r, kvd, dtype=d),
            v=torch.zeros(r, kvd, dtype=d),
            attn=torch.zeros(r, qd, dtype=d),
            gate=torch.zeros(r, g.intermediate, dtype=d),
            up=torch.zeros(r, g.intermediate, dtype=d),
            act=torch.zeros(r, g.intermediate, dtype=d),
            logits=torch.zeros(r, g.vocab, dtype=d),
        )


def _llama_geometry(model: nn.Module) -> _Geometry:
    """The geometry of a model :class:`NativeDecoder` has checked to be Llama-shaped, or why the kernels do not
    take it (head size past 256 or not a multiple of 8, query heads not a multiple of the KV heads)."""
    config, layers = model.config, model.model.layers
    heads = int(config.num_attention_heads)
    g = _Geometry(
        dtype=model.model.embed_tokens.weight.dtype,
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(layers[0].self_attn.head_dim),
        hidden=int(config.hidden_size),
        intermediate=int(layers[0].mlp.gate_proj.out_features),
        vocab=int(model.lm_head.out_features),
    )
    if g.head_dim > 256 or g.head_dim % 8 or g.heads % g.kv_heads:
        raise NotNativeDecodable(f"head size {g.head_dim} / heads {g.heads}:{g.kv_heads} not taken")
    return g


class _KernelBinder:
    """Binds each linear layer of the model to a kernel call on the step's buffers (a float, int8 or 4-bit native
    kernel; sibling float products in one call), checking each weight's dtype, layout and shape on the way. Apart
    from the decoder because it runs once, at set-up: the step only calls what it bound. Biases are converted once
    and kept alive in ``keep``, since the calls hold only their pointers."""

    def __init__(self, geometry: _Geometry, buffers: _StepBuffers, config: object):
        self.geometry = geometry
        self.buffers = buffers
        self.config = config
        self.keep: list[torch.Tensor] = []

    def layer(self, layer: nn.Module) -> _Layer:
        """One decoder layer's norms and products, or why the step cannot run it (a sliding window, other shapes)."""
        attn, mlp, g, buf = layer.self_attn, layer.mlp, self.geometry, self.buffers
        if getattr(attn, "sliding_window", None) is not None or getattr(self.config, "sliding_window", None):
            if getattr(self.config, "use_sliding_window", True) is not False:
                raise NotNativeDecodable("a layer attends over a sliding window")
        if int(attn.head_dim) != g.head_dim or mlp.gate_proj.out_features != g.intermediate:
            raise NotNativeDecodable("layers differ in shape")
        qkv = self.products([attn.q_proj, attn.k_proj, attn.v_proj], buf.x, [buf.q, buf.k, buf.v])
        gate_up = self.products([mlp.gate_proj, mlp.up_proj], buf.x, [buf.gate, buf.up])
        return _Layer(
            index=int(attn.layer_idx),
            input_norm=_rms(layer.input_layernorm, g.dtype),
            post_norm=_rms(layer.post_attention_layernorm, g.dtype),
            head_norms=self._head_norms(attn),
            qkv=qkv,
            o=self.product(attn.o_proj, buf.attn, buf.delta),
            gate_up=gate_up,
            down=self.product(mlp.down_proj, buf.act, buf.delta),
            scale=float(attn.scaling),
            module=layer,
        )

    def _head_norms(self, attn: nn.Module) -> tuple[tuple[int, float], tuple[int, float]] | None:
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None and k_norm is None:
            return None
        g = self.geometry
        if q_norm is None or k_norm is None or any(n.weight.shape != (g.head_dim,) for n in (q_norm, k_norm)):
            raise NotNativeDecodable("the attention normalises q or k in a way the step does not")
        return _rms(q_norm, g.dtype), _rms(k_norm, g.dtype)

    def _float_weight(self, linear: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        if type(linear) is not NativeCPULinear:
            return None
        w, dtype = linear.weight, self.geometry.dtype
        if w.dtype is not dtype or not w.is_cpu or w.dim() != 2 or w.stride(1) != 1:
            raise NotNativeDecodable(f"a linear weight is {w.dtype} {tuple(w.shape)}, not row-contiguous {dtype}")
        if w.shape[1] != x.shape[1] or w.shape[0] != out.shape[1]:
            raise NotNativeDecodable("a linear layer's shape differs from the model's")
        return w

    def _bias(self, linear: nn.Module) -> int | None:
        b = getattr(linear, "bias", None)
        if b is None:
            return None
        b = b.detach().to(self.geometry.dtype).contiguous()
        self.keep.append(b)
        return b.data_ptr()

    def products(self, linears: Sequence[nn.Module], x: torch.Tensor, outs: Sequence[torch.Tensor]) -> list[_Product]:
        """Sibling products of one input: one ``*_multi`` call where every weight is a float native one, else one
        call each (the quantized kernels gain nothing from sharing a call: measured, see docs/kernels.md)."""
        weights = [self._float_weight(m, x, o) for m, o in zip(linears, outs)]
        if any(w is None for w in weights):
            return [self.product(m, x, o) for m, o in zip(linears, outs)]
        fn = kernel_build.function(kernel_build.KERNELS[self.geometry.dtype].multi)
        count = len(linears)
        ptrs = ctypes.c_void_p * count
        ws = ptrs(*(w.data_ptr() for w in weights))
        ldw = (ctypes.c_long * count)(*(w.stride(0) for w in weights))
        bs = ptrs(*(self._bias(m) for m in linears))
        os_ = ptrs(*(o.data_ptr() for o in outs))
        ldo = (ctypes.c_long * count)(*(o.stride(0) for o in outs))
        ns = (ctypes.c_int * count)(*(w.shape[0] for w in weights))
        xp, ldx, k = x.data_ptr(), x.stride(0), x.shape[1]
        arrays = (ws, ldw, bs, os_, ldo, ns)  # kept alive by the closure

        def call(m: int, threads: int) -> None:
            if fn(xp, ldx, count, *arrays, m, k, threads) != 0:
                raise RuntimeError("the native multi-product kernel rejected a decode step's shapes")

        return [_Product(call, _bytes_of(linears))]

    def product(self, linear: nn.Module, x: torch.Tensor, out: torch.Tensor) -> _Product:
        """``out = x @ W^T (+ b)`` on the float kernel of the model's dtype, or the int8 or 4-bit one."""
        xp, ldx, k = x.data_ptr(), x.stride(0), x.shape[1]
        yp, ldy, n = out.data_ptr(), out.stride(0), out.shape[1]
        bias = self._bias(linear)
        w = self._float_weight(linear, x, out)
        if w is not None:
            fn = kernel_build.function(kernel_build.KERNELS[self.geometry.dtype].name)
            wp, ldw = w.data_ptr(), w.stride(0)

            def call(m: int, threads: int) -> None:
                if fn(xp, ldx, wp, ldw, bias, yp, ldy, m, n, k, threads) != 0:
                    raise RuntimeError("the native linear kernel rejected a decode step's shapes")

            return _Product(call, _bytes_of([linear]))
        if isinstance(linear, Fp8CPULinear):
            return self._fp8_product(linear, x, out, bias)
        if isinstance(linear, Mxfp4CPULinear):
            return self._mxfp4_product(linear, x, out, bias)
        if isinstance(linear, Bnb4CPULinear):
            cd, am, tb = linear.codes, linear.absmax, linear.table
            args = (cd.data_ptr(), cd.stride(0), am.data_ptr(), am.stride(0), linear.blocksize, tb.data_ptr())
            return self._stored_product("linear_nf4", "bitsandbytes 4-bit", linear, x, out, bias, args)
        if not isinstance(linear, QuantizedCPULinear):
            raise NotNativeDecodable(f"{type(linear).__name__} layers are not on a native kernel")
        if linear.in_features != k or linear.out_features != n:
            raise NotNativeDecodable("a quantized layer's shape differs from the model's")
        if linear.perm is not None:
            raise NotNativeDecodable("a layer stored in act-order (its inputs permuted) is not on the decode step")
        qw, sc, bf16 = linear.qweight, linear.scales, self.geometry.bf16
        if linear.scheme == "int8":
            fn = kernel_build.function("linear_q8")
            args = (qw.data_ptr(), qw.stride(0), sc.data_ptr())
        elif linear.zeros is not None:
            fn = kernel_build.function("linear_q4z")
            zs = linear.zeros
            args = (qw.data_ptr(), qw.stride(0), sc.data_ptr(), sc.stride(0), zs.data_ptr(), zs.stride(0))
        else:
            fn = kernel_build.function("linear_q4")
            args = (qw.data_ptr(), qw.stride(0), sc.data_ptr(), sc.stride(0))

        def qcall(m: int, threads: int) -> None:
            if fn(xp, ldx, bf16, *args, bias, yp, ldy, m, n, k, threads) != 0:
                raise RuntimeError("the native quantized kernel rejected a decode step's shapes")

        return _Product(qcall, _bytes_of([linear]))

    def _fp8_product(self, linear: Fp8CPULinear, x: torch.Tensor, out: torch.Tensor, bias: int | None) -> _Product:
        """``out = x @ W^T (+ b)`` on the FP8 kernel, reading the layer's stored e4m3 bytes."""
        w, sc = linear.weight, linear.scales
        args = (w.data_ptr(), w.stride(0), sc.data_ptr(), sc.stride(0), linear.block_rows, linear.block_cols)
        return self._stored_product("linear_fp8", "FP8", linear, x, out, bias, args)

    def _mxfp4_product(self, linear: Mxfp4CPULinear, x: torch.Tensor, out: torch.Tensor, bias: int | None) -> _Product:
        """``out = x @ W^T (+ b)`` on the MXFP4 kernel, reading the layer's stored blocks and e8m0 scales."""
        bl, sc = linear.blocks, linear.scales
        args = (bl.data_ptr(), bl.stride(0), sc.data_ptr(), sc.stride(0))
        return self._stored_product("linear_mxfp4", "MXFP4", linear, x, out, bias, args)

    def _stored_product(
        self, kernel: str, label: str, linear: nn.Module, x: torch.Tensor, out: torch.Tensor, bias: int | None, args
    ) -> _Product:
        """A kernel that reads a checkpoint's stored weight in place (FP8, MXFP4, nf4/fp4): ``args`` are the weight's
        pointers and strides, between ``x, ldx, bf16`` and ``bias, y, ldy, M, N, K, threads``."""
        xp, ldx, k = x.data_ptr(), x.stride(0), x.shape[1]
        yp, ldy, n = out.data_ptr(), out.stride(0), out.shape[1]
        if linear.in_features != k or linear.out_features != n:
            raise NotNativeDecodable(f"an {label} layer's shape differs from the model's")
        bf16, fn = self.geometry.bf16, kernel_build.function(kernel)

        def call(m: int, threads: int) -> None:
            if fn(xp, ldx, bf16, *args, bias, yp, ldy, m, n, k, threads) != 0:
                raise RuntimeError(f"the native {label} kernel rejected a decode step's shapes")

        return _Product(call, _bytes_of([linear]))


def _bytes_of(modules: Sequence[nn.Module]) -> int:
    """Bytes of the modules' parameters and buffers: what their products read per step."""
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


class NativeDecoder:
    """Decode steps of one model on the native kernels (see the module docstring). Build with :meth:`for_model`.
    One step at a time: the steps share the decoder's buffers (the engine's thread runs them)."""

    def __init__(self, model: nn.Module):
        config = model.config
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        head = getattr(model, "lm_head", None)
        if inner is None or layers is None or head is None or getattr(config, "is_encoder_decoder", False):
            raise NotNativeDecodable("not a decoder-only model with model.layers and lm_head")
        names = {type(layer).__name__ for layer in layers}
        if not names <= set(LLAMA_LAYERS):
            raise NotNativeDecodable(f"layers {', '.join(sorted(names))} are not Llama-shaped")
        if getattr(config, "hidden_act", None) not in ("silu", "swish"):
            raise NotNativeDecodable(f"the MLP's activation is {config.hidden_act!r}, not SiLU")
        rotary = getattr(inner, "rotary_emb", None)
        if rotary is None or getattr(rotary, "rope_type", None) not in FIXED_ROPE_TYPES:
            raise NotNativeDecodable(f"rotary type {getattr(rotary, 'rope_type', None)!r} is not position-fixed")
        embed = inner.embed_tokens
        dtype = embed.weight.dtype
        if dtype not in _DTYPES or not embed.weight.is_cpu:
            raise NotNativeDecodable(f"the embedding is {dtype} on {embed.weight.device}, not fp32 or bf16 on the CPU")
        self._modules = list(model.modules())
        if not self._hooks_allow_a_step():
            raise NotNativeDecodable("a module has forward hooks, which only its own forward would run")
        if not kernel_build.status().available:
            raise NotNativeDecodable(f"the native kernels are not loaded: {kernel_build.status().reason}")
        self.model = model
        self.geometry = _llama_geometry(model)
        self.embed = embed
        self.rotary = rotary
        self._fn = {
            name: kernel_build.function(name) for name in ("add_rms_norm", "rope_store", "silu_mul", "decode_attention")
        }
        self.buffers = _StepBuffers.allocate(self.geometry)
        binder = _KernelBinder(self.geometry, self.buffers, config)
        self.layers = [binder.layer(layer) for layer in layers]
        self.final_norm = _rms(inner.norm, dtype)
        self.head = binder.product(head, self.buffers.x, self.buffers.logits)
        self._keep = binder.keep  # biases converted for the kernels, whose pointers the calls hold
        self.final_norm_module, self.head_module = inner.norm, head
        staged = {id(m) for part in (embed, *layers, inner.norm, head) for m in part.modules()}
        #: Modules around the stages (``model.model``, ``model.model.layers``): their pre-hooks run first.
        self._outer = [m for m in self._modules[1:] if id(m) not in staged]
        self._cos = self._sin = torch.empty(0)
        #: Steps run so far (tests check that decode calls came here).
        self.steps = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> NativeDecoder | None:
        """The decoder for ``model``, or ``None`` (logged once, with the reason) where it does not apply.
        ``LOADMASTER_NATIVE_DECODE=0`` turns it off (decode steps then run the model's forward)."""
        setting = os.environ.get("LOADMASTER_NATIVE_DECODE", "1").strip().lower()
        if setting not in _ON + _OFF:
            raise ValueError(
                f"LOADMASTER_NATIVE_DECODE={setting!r} is not one of 1, 0 (or on/off, true/false, yes/no); "
                "unset it to run decode steps on the native kernels where the model allows it."
            )
        if setting in _OFF:
            log.info("decode steps run the model's forward (LOADMASTER_NATIVE_DECODE=%s)", setting)
            return None
        try:
            decoder = cls(model)
        except NotNativeDecodable as exc:
            log.info("decode steps run the model's forward: %s", exc)
            return None
        log.info("decode steps run on the native kernels end to end (%d layers)", len(decoder.layers))
        return decoder

    # -- the step ----------------------------------------------------------------------------------------------------
    def _rope_table(self, need: int) -> None:
        """cos and sin for positions ``[0, need)`` as the model's rotary module makes them, grown by doubling."""
        if self._cos.shape[0] >= need:
            return
        n = max(64, self._cos.shape[0])
        while n < need:
            n *= 2
        dtype = self.geometry.dtype
        probe = torch.zeros(1, dtype=dtype)
        cos, sin = self.rotary(probe, torch.arange(n).unsqueeze(0))
        self._cos = cos[0].to(dtype).contiguous()
        self._sin = sin[0].to(dtype).contiguous()

    # -- the step ----------------------------------------------------------------------------------------------------
    def takes(self, rows: int, keys: Mapping[int, torch.Tensor]) -> bool:
        """Whether a step of ``rows`` decode rows runs here: within :data:`MAX_ROWS`, every layer's cache made, and
        no hook that only the model's own forward would run (hooks may be added after the decoder was made)."""
        if not 0 < rows <= MAX_ROWS or not self._hooks_allow_a_step():
            return False
        return all(layer.index in keys for layer in self.layers)

    def _hooks_allow_a_step(self) -> bool:
        """No forward hooks, no pre-hooks that take keyword arguments, none on the model itself (they would expect
        its forward's arguments); plain pre-hooks below it (disk readahead) are called as the step reaches them.
        Checked at every step over a flat list of the modules (~20 us on the 1B)."""
        root = self._modules[0]
        if root._forward_pre_hooks or root._forward_hooks:  # noqa: SLF001
            return False
        for m in self._modules:
            if m._forward_hooks or m._forward_pre_hooks_with_kwargs:  # noqa: SLF001
                return False
        return True

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        keys: Mapping[int, torch.Tensor],
        values: Mapping[int, torch.Tensor],
    ) -> torch.Tensor:
        """One decode step: row ``b`` feeds token ``tokens[b]`` at position ``positions[b]`` of cache slot
        ``slots[b]`` (each ``[B]`` long, on the CPU); its key and value are written there, and it attends positions
        ``0 .. positions[b]`` of its slot. Returns the logits after each row's token, ``[B, vocab]``."""
        m = int(tokens.shape[0])
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous()
        pos_list = positions.tolist()
        slot_list = slots.tolist()
        self._rope_table(max(pos_list) + 1)
        threads = torch.get_num_threads()
        g, buf = self.geometry, self.buffers
        bf16 = g.bf16
        fn = self._fn
        h, x, delta = buf.h, buf.x, buf.delta
        hp, xp, dp = h.data_ptr(), x.data_ptr(), delta.data_ptr()
        ld = g.hidden
        runs, mask, span = _runs(pos_list, slot_list)
        mp = mask.data_ptr() if mask is not None else None
        es = h.element_size()
        # the element-wise calls' teams: a norm reads and writes its rows, silu_mul two inputs and an output
        t_norm = team(threads, 2 * m * ld * es)
        t_head_norm = team(threads, 2 * m * g.heads * g.head_dim * es)
        t_silu = team(threads, 3 * m * g.intermediate * es)
        hooks = any(m._forward_pre_hooks for m in self._modules)  # noqa: SLF001 - disk readahead's, usually none
        if hooks:
            _call_hooks([m for m in self._outer if m._forward_pre_hooks] + _hooked(self.embed))  # noqa: SLF001
        torch.index_select(self.embed.weight, 0, tokens.to(torch.int64), out=h[:m])
        rc = 0  # the element-wise kernels' return codes, OR-ed: non-zero means one refused its shapes
        first = True
        for layer in self.layers:
            if hooks:
                _call_hooks(_hooked(layer.module))
            kc, vc = keys[layer.index], values[layer.index]
            w, eps = layer.input_norm
            # the previous layer's MLP output joins the residual stream here, then this layer's input norm
            rc |= fn["add_rms_norm"](hp, ld, None if first else dp, ld, w, xp, ld, m, ld, eps, bf16, t_norm)
            first = False
            for p in layer.qkv:
                p.run(m, threads)
            if layer.head_norms is not None:  # each head of q and k normalised on its own, in place
                d = g.head_dim
                for qk, heads, (w, eps) in zip((buf.q, buf.k), (g.heads, g.kv_heads), layer.head_norms):
                    p = qk.data_ptr()
                    rc |= fn["add_rms_norm"](p, d, None, d, w, p, d, m * heads, d, eps, bf16, t_head_norm)
            rc |= fn["rope_store"](
                buf.q.data_ptr(), buf.q.stride(0), buf.k.data_ptr(), buf.k.stride(0), buf.v.data_ptr(),
                buf.v.stride(0), self._cos.data_ptr(), self._sin.data_ptr(), self._cos.stride(0),
                positions.data_ptr(), slots.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1),
                kc.stride(2), m, g.heads, g.kv_heads, g.head_dim, bf16,
            )  # fmt: skip
            self._attend(layer, kc, vc, runs, mp, span, threads)
            layer.o.run(m, threads)
            w, eps = layer.post_norm
            rc |= fn["add_rms_norm"](hp, ld, dp, ld, w, xp, ld, m, ld, eps, bf16, t_norm)
            for p in layer.gate_up:
                p.run(m, threads)
            rc |= fn["silu_mul"](
                buf.gate.data_ptr(), g.intermediate, buf.up.data_ptr(), g.intermediate, buf.act.data_ptr(),
                g.intermediate, m, g.intermediate, bf16, t_silu,
            )  # fmt: skip
            layer.down.run(m, threads)
        if hooks:
            _call_hooks(_hooked(self.final_norm_module) + _hooked(self.head_module))
        w, eps = self.final_norm
        rc |= fn["add_rms_norm"](hp, ld, dp, ld, w, xp, ld, m, ld, eps, bf16, t_norm)
        if rc:
            raise RuntimeError(f"a native decoder kernel (norm, rotary or activation) rejected a step of {m} rows")
        self.head.run(m, threads)
        self.steps += 1
        return buf.logits[:m].clone()

    def _attend(
        self,
        layer: _Layer,
        kc: torch.Tensor,
        vc: torch.Tensor,
        runs: list[_AttentionRun],
        mask_ptr: int | None,
        span: int,
        threads: int,
    ) -> None:
        """Attention of each run of rows in consecutive slots over its slots' keys, into the ``attn`` buffer."""
        g, buf = self.geometry, self.buffers
        es = kc.element_size()
        qd = g.heads * g.head_dim
        d = g.head_dim
        for run in runs:
            # each row's keys and values are read once per KV head: the call's bytes
            work = run.rows * run.keys * g.kv_heads * d * 2 * es
            rc = self._fn["decode_attention"](
                buf.q.data_ptr() + run.first * qd * es, qd, d, 0,
                kc.data_ptr() + run.slot * kc.stride(0) * es, kc.stride(0), kc.stride(1), kc.stride(2),
                vc.data_ptr() + run.slot * vc.stride(0) * es, vc.stride(0), vc.stride(1), vc.stride(2),
                (mask_ptr + run.first * span) if run.masked and mask_ptr is not None else None, span, 0,
                buf.attn.data_ptr() + run.first * qd * es, qd, qd, d,
                run.rows, g.heads, g.kv_heads, 1, run.keys, d, layer.scale, g.bf16, team(threads, work),
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"the native attention kernel rejected a decode step ({rc})")


@dataclass(frozen=True)
class _AttentionRun:
    """Rows ``first .. first + rows`` of a step, in consecutive slots from ``slot``: one attention call over keys
    ``[0, keys)`` of those slots, with the step's mask where their lengths differ."""

    first: int
    rows: int
    slot: int
    keys: int
    masked: bool


def _runs(positions: list[int], slots: list[int]) -> tuple[list[_AttentionRun], torch.Tensor | None, int]:
    """The step's attention runs, and the mask they share where some run needs one: row ``b`` attends keys
    ``0 .. positions[b]``, one row of ``span`` booleans per row."""
    runs = []
    start = 0
    for b in range(1, len(slots) + 1):
        if b == len(slots) or slots[b] != slots[b - 1] + 1:
            lengths = positions[start:b]
            runs.append(_AttentionRun(start, b - start, slots[start], max(lengths) + 1, min(lengths) != max(lengths)))
            start = b
    span = max(positions) + 1
    if not any(r.masked for r in runs):
        return runs, None, span
    mask = torch.arange(span).unsqueeze(0) <= torch.tensor(positions).unsqueeze(1)
    return runs, mask.contiguous(), span


def _hooked(module: nn.Module) -> list[nn.Module]:
    """The modules under ``module`` (itself included) with forward pre-hooks, in the order a forward meets them."""
    return [m for m in module.modules() if m._forward_pre_hooks]  # noqa: SLF001


def _call_hooks(modules: list[nn.Module]) -> None:
    for m in modules:
        for hook in list(m._forward_pre_hooks.values()):  # noqa: SLF001
            hook(m, ())


# -- the element-wise kernels on tensors (tests check them against transformers' modules) ---------------------------
def _flag(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPES or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"the decoder kernels take contiguous float32 or bfloat16 CPU tensors, not {t.dtype}")
    return int(t.dtype is torch.bfloat16)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (if given), then ``RMSNorm(h) * weight`` as a new tensor; ``h`` is ``[rows, n]``."""
    bf16 = _flag(h)
    rows, n = h.shape
    out = torch.empty_like(h)
    ptr = None if delta is None else delta.data_ptr()
    fn = kernel_build.function("add_rms_norm")
    if fn(h.data_ptr(), n, ptr, n, weight.data_ptr(), out.data_ptr(), n, rows, n, eps, bf16, torch.get_num_threads()):
        raise ValueError(f"add_rms_norm rejected {tuple(h.shape)}")
    return out


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    kcache: torch.Tensor,
    vcache: torch.Tensor,
) -> None:
    """Rotate ``q`` (``[rows, H * D]``) in place, rotate ``k`` and copy ``v`` (``[rows, KV * D]``) into the caches
    (``[slots, KV, capacity, D]``) at each row's slot and position; ``cos``/``sin`` are ``[positions, D]``."""
    bf16 = _flag(q)
    rows, d = q.shape[0], kcache.shape[3]
    fn = kernel_build.function("rope_store")
    pos, sl = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    rc = fn(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(),
        sin.data_ptr(), cos.stride(0), pos.data_ptr(), sl.data_ptr(), kcache.data_ptr(), vcache.data_ptr(),
        kcache.stride(0), kcache.stride(1), kcache.stride(2), rows, q.shape[1] // d, kcache.shape[1], d, bf16,
    )  # fmt: skip
    if rc:
        raise ValueError(f"rope_store rejected q {tuple(q.shape)} and a cache {tuple(kcache.shape)}")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[rows, n]`` tensors."""
    bf16 = _flag(gate)
    rows, n = gate.shape
    out = torch.empty_like(gate)
    fn = kernel_build.function("silu_mul")
    if fn(gate.data_ptr(), n, up.data_ptr(), n, out.data_ptr(), n, rows, n, bf16, torch.get_num_threads()):
        raise ValueError(f"silu_mul rejected {tuple(gate.shape)}")
    return out
