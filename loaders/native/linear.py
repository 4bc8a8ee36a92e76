"""Decode-time linear layers on the CPU through the native kernels, with the model otherwise untouched.

:func:`use_native_linears` changes the class of each eligible ``nn.Linear`` to :class:`NativeCPULinear`, a
subclass whose ``forward`` sends small bf16 and fp32 products on the CPU to the ``loadmaster::linear`` operator
(:mod:`loaders.native.operators`, backed by :mod:`loaders.native.kernel_build`) and
everything else (long prefills, other dtypes, GPU inputs, autograd) to ``nn.Linear.forward``. Parameters are not
copied or moved: ``state_dict``, tied weights, memory accounting and zero-copy ``"disk"`` weights (views of the
shard maps) are exactly as they were.

Sibling projections that read one input (a self-attention block's ``q_proj``, ``k_proj`` and ``v_proj``; an MLP's
``gate_proj`` and ``up_proj``) form a :class:`SharedInputGroup`: the first of them to be called runs all their
products in one ``loadmaster::linear_multi`` call, and the others take their result when called with that same
tensor. At decode, a layer then forks the kernel's thread team 4 times instead of 7, and the small k and v products
no longer run on their own (at 16 rows on the 100M Llama, about a fifth of the time in linear layers). The results
are bit for bit those of the separate calls.

In bfloat16, products of several tokens per row (``[B, T, K]`` with ``T > 1``: a prompt, alone or packed) run on
torch's GEMM, and one-token rows (decode) on the native kernel (up to the 32 rows it takes). A prompt's product is
compute-bound, where torch's blocked GEMM is faster (366 GFLOP/s at 256 rows against the native kernel's ~230, on
two cores of an AVX-512 EPYC), and torch's bf16 GEMM gives a row the same bits whatever rows share the call
(:func:`torch_rows_independent` checks it for a model's weights on the CPU at hand), so a prompt row's result does
not depend on its batch either. Sizing by the row count instead would let a short prompt alone take the native
kernel and the same prompt next to others take torch's, a one-ulp difference that can turn a greedy token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from loaders.native import kernel_build, operators
from planner.hardware.calibration import machine_id
from planner.user_cache import write_text_atomically

log = logging.getLogger(__name__)

#: Values of ``load_model(cpu_kernels=...)``.
CPU_KERNEL_CHOICES = ("auto", "native", "torch")


#: Names of sibling linear layers that one module calls on the same input, in the models transformers ships
#: (Llama, Mistral, Qwen, Gemma and their kin): attention's projections and a gated MLP's two input projections.
SHARED_INPUT_SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInputGroup:
    """Linear layers called one after another on the same input tensor, computed together on the first call.

    The first member called with a tensor ``x`` runs every member's product (one native call) and keeps the
    others' results; a member then called with that same tensor object takes its result, and a member called with
    any other tensor (a model that feeds its siblings differently) computes its own and drops what was kept. What
    is kept lives per thread (the device pipeline runs stages on threads) and only until its members take it."""

    def __init__(self, members: Sequence[NativeCPULinear]):
        self.members = list(members)
        self._kept = threading.local()

    def output(self, member: NativeCPULinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s product with ``x``, from the shared call; ``None`` where the kernel does not take it."""
        index = self.members.index(member)
        kept = getattr(self._kept, "value", None)
        if kept is not None and kept[0] is x and kept[1][index] is not None:
            out = kept[1][index]
            kept[1][index] = None
            if all(o is None for o in kept[1]):
                self._kept.value = None
            return out
        self._kept.value = None
        if not all(native_takes(x, m.weight) for m in self.members):
            return None
        outs = operators.linear_multi(x, [m.weight for m in self.members], [m.bias for m in self.members])
        out = outs[index]
        outs[index] = None
        self._kept.value = (x, outs)
        return out


class NativeCPULinear(nn.Linear):
    """An ``nn.Linear`` whose small CPU products (bf16 or fp32) run on the native kernel."""

    #: The siblings this layer is computed with, if any (set by :func:`group_shared_inputs`).
    shared_input_group: SharedInputGroup | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's argument name)
        group = self.shared_input_group
        if group is not None:
            out = group.output(self, input)
            if out is not None:
                return out
        if native_takes(input, self.weight):
            return operators.linear(input, self.weight, self.bias)
        return super().forward(input)


def native_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight^T`` runs on the native kernel: what :func:`loaders.native.operators.supports` takes, except
    bf16 products of several tokens per row (see the module docstring)."""
    if weight.dtype is torch.bfloat16 and x.dim() >= 3 and x.shape[-2] > 1:
        return False
    return operators.supports(x, weight)


def group_shared_inputs(model: nn.Module) -> int:
    """Group the native sibling projections of every module (:data:`SHARED_INPUT_SIBLINGS`) that share a dtype
    and input width; return how many groups were made. Not for encoder-decoder models, whose cross-attention feeds
    its key and value projections another input than its query's."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return 0
    groups = 0
    for module in model.modules():
        for names in SHARED_INPUT_SIBLINGS:
            members = [getattr(module, n, None) for n in names]
            if not all(type(m) is NativeCPULinear for m in members):
                continue
            first = members[0].weight
            if any(m.weight.dtype != first.dtype or m.in_features != members[0].in_features for m in members):
                continue
            group = SharedInputGroup(members)
            for m in members:
                m.shared_input_group = group
            groups += 1
    return groups


def use_native_linears(model: nn.Module, choice: str = "auto") -> int:
    """Switch eligible linear layers to the native kernels; return how many were switched.

    ``"auto"`` switches where the kernel for the weight's dtype is available and quietly keeps torch otherwise;
    ``"native"`` raises when it is not; ``"torch"`` switches nothing. Eligible: exactly ``nn.Linear`` (not a
    quantized or otherwise specialised subclass) with a bf16 or fp32 weight on the CPU or a memory map.
    """
    if choice not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernels={choice!r} is not one of {', '.join(CPU_KERNEL_CHOICES)}.")
    if choice == "torch":
        return 0
    by_dtype: dict[torch.dtype, list[nn.Linear]] = {}
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype in kernel_build.KERNELS and m.weight.device.type == "cpu":
            by_dtype.setdefault(m.weight.dtype, []).append(m)
    switched = 0
    for dtype, mods in by_dtype.items():
        st = kernel_build.status(dtype)
        name = str(dtype).removeprefix("torch.")
        if not st.available:
            if choice == "native":
                raise RuntimeError(
                    f"cpu_kernels='native' was asked for, but for {name}: {st.reason}. Use 'auto' or 'torch'."
                )
            log.info("%s linear layers stay on torch: %s", name, st.reason)
            continue
        for m in mods:
            m.__class__ = NativeCPULinear
        switched += len(mods)
        log.info("%d %s linear layers run on the native CPU kernel (%s path)", len(mods), name, st.isa)
    if switched:
        log.info("%d groups of sibling projections share one kernel call each", group_shared_inputs(model))
    return switched


#: Row counts the probe of :func:`torch_rows_independent` multiplies, each as (first row, rows), against the same
#: rows inside one product of all of them: one row, a few, and a packed prompt's worth, at different offsets.
_PROBE_ROWS = ((0, 1), (1, 3), (5, 33), (2, 270))


def torch_rows_independent(
    weights: Sequence[torch.Tensor], product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
) -> bool:
    """Whether ``product`` (torch's GEMM) gives each row of ``x @ w^T`` the same bits whatever rows share the call,
    for each of ``weights`` on this CPU (probed with random rows). oneDNN promises reproducible results for one
    implementation, not across the implementations it may pick for different row counts; packing bf16 prompts
    relies on it."""
    g = torch.Generator().manual_seed(0)
    rows = max(start + n for start, n in _PROBE_ROWS)
    with torch.inference_mode():
        for w in weights:
            x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
            whole = product(x, w)
            for start, n in _PROBE_ROWS:
                if not torch.equal(product(x[start : start + n], w), whole[start : start + n]):
                    return False
    return True


#: Bump when the probe or its key changes meaning, so earlier answers are not read.
PROBE_FORMAT = 1
#: Environment variables that can change which GEMM torch (oneDNN, MKL, OpenMP) runs.
_GEMM_ENV_PREFIXES = ("ONEDNN_", "DNNL_", "MKL_", "OMP_", "KMP_", "ATEN_CPU_CAPABILITY")


def probe_cache_dir() -> Path:
    """Where probe answers live: ``probes`` beside the built kernels (:func:`loaders.native.kernel_build.cache_dir`)."""
    return kernel_build.cache_dir() / "probes"


def rows_independent_on_this_cpu(weights: Sequence[torch.Tensor]) -> bool:
    """:func:`torch_rows_independent` for torch's GEMM, answered from the user's cache when the same question was
    probed before: same torch build and CPU (model, cores, feature flags), thread count, GEMM environment, and weights of the same dtypes, shapes,
    strides and 64-byte alignment (what picks oneDNN's implementation; the values do not). The probe costs ~0.1 s of
    every start on the 1B model; a cached answer a millisecond. An unreadable or unwritable cache only means probing."""
    key = {
        "format": PROBE_FORMAT,
        "probe_rows": [list(r) for r in _PROBE_ROWS],
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": [machine_id(), sorted(kernel_build.cpu_flags())],
        "threads": torch.get_num_threads(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_GEMM_ENV_PREFIXES)},
        "weights": [[str(w.dtype), list(w.shape), list(w.stride()), w.data_ptr() % 64] for w in weights],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = probe_cache_dir() / f"rows-independent-{digest}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("key") == key and isinstance(stored.get("independent"), bool):
            return stored["independent"]
    except (OSError, ValueError, AttributeError):
        pass
    independent = torch_rows_independent(weights)
    try:
        write_text_atomically(path, json.dumps({"key": key, "independent": independent}))
    except OSError as exc:
        log.debug("row-independence answer not cached in %s: %s", path.parent, exc)
    return independent
