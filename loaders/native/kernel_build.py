"""Native CPU kernels for decode-time linear layers: which instruction set, built once into a cache, bound by ctypes.

Why native code: at decode time a linear layer multiplies one row (or a few) by its weight matrix, which is read
once per token, so its speed is the memory bandwidth it reaches. torch's CPU paths reach about half of it for
bfloat16, and for float32 MKL's small-M path reaches a quarter to a half. The sources in ``kernels/`` read the
weight rows in place and get close to the streaming rate; because they read a weight where it lies, a weight
that is a view of a safetensors file mapping stays zero-copy. Seven linear kernels: bf16, fp32, weight-only int8
and 4-bit (:mod:`loaders.native.quantization` lays those weights out), and FP8 e4m3, MXFP4 and bitsandbytes
nf4/fp4 as checkpoints store them (:mod:`loaders.native.fp8_linear`, :mod:`loaders.native.mxfp4_linear`,
:mod:`loaders.native.bnb_4bit`); and decode attention over the slot cache (:mod:`loaders.native.attention`).

**Instruction sets.** Every source has an AVX-512 path and an AVX2 (+FMA, F16C) path (``linear_nf4.c`` has only the
AVX2 one, which the AVX-512 builds compile too). The path is picked from the
CPU's flags (:func:`select_isa`), or forced with ``LOADMASTER_CPU_ISA=avx512|avx2|torch``; anywhere else (no
x86, no AVX2, no compiler) torch's kernels run. ``LOADMASTER_CPU_KERNELS=torch`` is the older spelling of
``LOADMASTER_CPU_ISA=torch`` and is still honoured.

**Built once.** All sources of one path build into one library in the user's cache, at first use (or ahead of
time with :func:`build_all`, as the Docker image's build stage does). Its name carries a key of the sources'
hash, the flags, the path and the compiler's identity, and a manifest next to it records them; a library is used
only when its manifest matches and the library itself reports the path it was asked for. A serve with a warm
cache builds nothing. Builds write a temporary name and rename it, so concurrent first uses never see a
half-written library. Where no compiler is installed, a library built elsewhere for the same sources and path is
used; otherwise one log line says so and torch's kernels run.

Why ctypes and not a C++ torch extension: the sources include no torch header, so a path builds in a couple of
seconds with the system C compiler and needs no build step at install. The kernels are still torch operators:
:mod:`loaders.native.operators` registers them with ``torch.library`` (shape and dtype checks, fake tensors).
``-fopenmp`` binds to the OpenMP runtime torch already loaded (same soname) and every call passes
``torch.get_num_threads()``, so the kernels run on torch's threads, as many as torch uses.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from planner.user_cache import replace_atomically, user_cache_path, write_text_atomically

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
SOURCES = (
    "isa.c",
    "linear_bf16.c",
    "linear_f32.c",
    "linear_q8.c",
    "linear_q4.c",
    "linear_fp8.c",
    "linear_mxfp4.c",
    "linear_nf4.c",
    "quantize_weights.c",
    "attention_decode.c",
    "decoder_ops.c",
)
HEADERS = ("common.h",)
_COMMON_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")
ISA_CHOICES = ("auto", "amx", "avx512", "avx2", "torch")


@dataclass(frozen=True)
class Isa:
    """One instruction-set path: the compiler flags that select it and the CPU flags it needs to run."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


#: Best first. AVX-512 here means the Zen 4 / Sapphire Rapids set (VNNI and BF16 included); an older AVX-512 CPU
#: takes the AVX2 path, which every kernel has.
ISAS: dict[str, Isa] = {
    # AVX-512 plus the AMX tile unit (Sapphire Rapids and later): bf16 products run on AMX-BF16 tiles, 16 rows of
    # x per tile, so a batch of decode rows costs about what one costs; every other kernel is the AVX-512 one.
    "amx": Isa(
        "amx",
        (
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512vnni",
            "-mavx512bf16",
            "-mfma",
            "-mf16c",
            "-mamx-tile",
            "-mamx-bf16",
        ),
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "fma", "f16c", "amx_tile", "amx_bf16"),
    ),
    "avx512": Isa(
        "avx512",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma", "-mf16c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "fma", "f16c"),
    ),
    "avx2": Isa("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
}


@dataclass(frozen=True)
class Kernel:
    """One native linear kernel: its exported symbol and how many activation rows it takes."""

    name: str
    #: Rows of activations up to which the kernel beats torch here (decode steps and small batches); beyond it
    #: the product is compute-bound and torch's blocked GEMM is the better choice.
    max_rows: int

    @property
    def symbol(self) -> str:
        return f"lm_{self.name}"

    @property
    def multi(self) -> str:
        """The entry that runs several products sharing one input in one call (float kernels only)."""
        return f"{self.name}_multi"


#: The float kernels, by weight dtype.
KERNELS: dict[torch.dtype, Kernel] = {
    torch.bfloat16: Kernel("linear_bf16", max_rows=32),
    torch.float32: Kernel("linear_f32", max_rows=32),
}
#: The weight-only quantized kernels, by scheme (:mod:`loaders.native.quantization`). The int8 and 4-bit ones take
#: prefills too (up to 4096 rows), so a row's result never depends on how many rows came with it: a grouped prefill
#: in the server gives the same tokens as a lone one. torch (on the dequantized weight) runs only beyond that. The
#: FP8 one computes in float32, so, like the float kernels, it takes decode rows and torch's GEMM runs prompts
#: (:mod:`loaders.native.fp8_linear`); so do the MXFP4 one (:mod:`loaders.native.mxfp4_linear`) and the nf4/fp4 one
#: (:mod:`loaders.native.bnb_4bit`), whose prompts run on tiles dequantized by torch.
QUANT_KERNELS: dict[str, Kernel] = {
    "int8": Kernel("linear_q8", max_rows=4096),
    "int4": Kernel("linear_q4", max_rows=4096),
    "fp8": Kernel("linear_fp8", max_rows=32),
    "mxfp4": Kernel("linear_mxfp4", max_rows=32),
    "nf4": Kernel("linear_nf4", max_rows=32),
}

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_ARGTYPES = {
    "linear_bf16": [_P, _L, _P, _L, _P, _P, _L, _I, _I, _I, _I],
    "linear_f32": [_P, _L, _P, _L, _P, _P, _L, _I, _I, _I, _I],
    # x, ldx, count, then per product arrays: weights, their row strides, biases, outputs, output strides, rows
    "linear_bf16_multi": [_P, _L, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I],
    "linear_f32_multi": [_P, _L, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I],
    "linear_q8": [_P, _L, _I, _P, _L, _P, _P, _P, _L, _I, _I, _I, _I],
    "linear_q4": [_P, _L, _I, _P, _L, _P, _L, _P, _P, _L, _I, _I, _I, _I],
    # linear_q4 with a float16 zero point per group after the scales: zeros, ldz
    "linear_q4z": [_P, _L, _I, _P, _L, _P, _L, _P, _L, _P, _P, _L, _I, _I, _I, _I],
    # x, ldx, bf16, e4m3 weight, ldw, float32 scales, their row stride, rows and inputs per scale, bias, y, ldy,
    # M, N, K, threads
    "linear_fp8": [_P, _L, _I, _P, _L, _P, _L, _I, _I, _P, _P, _L, _I, _I, _I, _I],
    # x, ldx, bf16, MXFP4 blocks (bytes), ldw, e8m0 scales (bytes), lds, bias, y, ldy, M, N, K, threads
    "linear_mxfp4": [_P, _L, _I, _P, _L, _P, _L, _P, _P, _L, _I, _I, _I, _I],
    # x, ldx, bf16, bitsandbytes 4-bit codes (bytes), ldw, float32 absmax, lda, block size, 16-float table, bias, y,
    # ldy, M, N, K, threads
    "linear_nf4": [_P, _L, _I, _P, _L, _P, _L, _I, _P, _P, _P, _L, _I, _I, _I, _I],
    # e4m3 weight, ldw, scales, lds, bn, bk, first row, rows, K, out, ldo, bf16, threads
    "dequantize_fp8": [_P, _L, _P, _L, _I, _I, _I, _I, _I, _P, _L, _I, _I],
    "quantize_q8": [_P, _L, _I, _I, _I, _P, _L, _P, _I],
    "quantize_q4": [_P, _L, _I, _I, _I, _P, _L, _P, _L, _I],
    # q and its 3 strides, k and its 3, v and its 3, mask and its 2, out and its 3; B, H, KV, T, L, D, scale, bf16,
    # threads
    "decode_attention": [_P, _L, _L, _L] * 3 + [_P, _L, _L] + [_P, _L, _L, _L] + [_I] * 6 + [_F, _I, _I],
    # the decoder layer's element-wise steps (kernels/decoder_ops.c, used by loaders/native/decode_step.py)
    # h, ldh, delta, ldd, weight, out, ldo, rows, n, eps, bf16, threads
    "add_rms_norm": [_P, _L, _P, _L, _P, _P, _L, _I, _I, _F, _I, _I],
    # q, ldq, k, ldk, v, ldv, cos, sin, ldc, positions, slots, kcache, vcache, 3 cache strides, rows, H, KV, D, bf16
    "rope_store": [_P, _L, _P, _L, _P, _L, _P, _P, _L, _P, _P, _P, _P, _L, _L, _L, _I, _I, _I, _I, _I],
    # gate, ldg, up, ldu, out, ldo, rows, n, bf16, threads
    "silu_mul": [_P, _L, _P, _L, _P, _L, _I, _I, _I, _I],
}


@dataclass(frozen=True)
class KernelStatus:
    """Whether the native kernels are in use, on which path, and if not, why (for logs, ``/info`` and tests)."""

    available: bool
    reason: str
    library: str | None = None
    isa: str | None = None


@dataclass(frozen=True)
class BuildManifest:
    """What a cached library was built from; written next to it and checked before it is loaded."""

    isa: str
    source_hash: str
    cflags: list[str]
    compiler: str
    #: The library file's own size and SHA-256, so that a truncated or altered library is rebuilt, never loaded.
    size: int = -1
    sha256: str = ""


class _Library:
    """The bound functions of one loaded library."""

    def __init__(self, path: Path, isa: str):
        lib = _load_private_copy(path)
        lib.lm_isa.restype = ctypes.c_char_p
        built_for = lib.lm_isa().decode()
        if built_for != isa:
            raise OSError(f"{path} holds the {built_for} path, not {isa}")
        self.fns: dict[str, ctypes._CFuncPtr] = {}
        for name, argtypes in _ARGTYPES.items():
            fn = getattr(lib, f"lm_{name}")
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
            self.fns[name] = fn


_private_copies: list[int] = []  # memfds of loaded libraries, open while the process lives


def _load_private_copy(path: Path) -> ctypes.CDLL:
    """Load ``path`` from a private in-memory copy (a memfd), checked against its manifest's hash: the cache file
    can then be truncated or rewritten under a running process without a SIGBUS (a mapped file that shrinks
    kills the process that maps it). Falls back to the file itself where there is no memfd."""
    image = path.read_bytes()
    try:
        manifest = json.loads(path.with_suffix(".json").read_text())
        if hashlib.sha256(image).hexdigest() != manifest.get("sha256"):
            raise OSError(f"{path} changed since it was checked (its hash no longer matches its manifest)")
        fd = os.memfd_create(f"loadmaster-{path.name}")
    except (AttributeError, ValueError):  # no memfd on this system
        return ctypes.CDLL(str(path))
    view = memoryview(image)
    while view:
        view = view[os.write(fd, view) :]
    # The descriptor stays open for the life of the process: the dynamic loader knows a library by the name it was
    # opened as, so a closed descriptor's number, reused for the next path's copy, would hand back the first one.
    _private_copies.append(fd)
    return ctypes.CDLL(f"/proc/self/fd/{fd}")


_lock = threading.Lock()
_state: dict[str, object] = {}  # "status": KernelStatus, "lib": _Library
_reset_hooks: list[Callable[[], None]] = []  # caches of bound functions elsewhere (kernel_ops) to drop on reset


def cpu_flags() -> set[str]:
    """The CPU feature flags the kernel reports (Linux ``/proc/cpuinfo``); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable_isas() -> list[str]:
    """The paths this CPU can run, best first (empty off x86-64 Linux)."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    flags = cpu_flags()
    return [name for name, isa in ISAS.items() if all(f in flags for f in isa.cpu_flags)]


def requested_isa() -> str:
    """``LOADMASTER_CPU_ISA`` (or the older ``LOADMASTER_CPU_KERNELS=torch``), validated."""
    if os.environ.get("LOADMASTER_CPU_KERNELS", "auto").lower() == "torch":
        return "torch"
    choice = os.environ.get("LOADMASTER_CPU_ISA", "auto").strip().lower() or "auto"
    if choice not in ISA_CHOICES:
        raise ValueError(
            f"LOADMASTER_CPU_ISA={choice!r} is not one of {', '.join(ISA_CHOICES)}; "
            "unset it to pick from the CPU's flags."
        )
    return choice


def select_isa() -> tuple[str | None, str]:
    """The path to use and why: the best the CPU runs, or the forced one if the CPU runs it; ``None`` for torch."""
    choice = requested_isa()
    if choice == "torch":
        return None, "torch's kernels forced by LOADMASTER_CPU_ISA=torch (or LOADMASTER_CPU_KERNELS=torch)"
    runnable = runnable_isas()
    if choice == "auto":
        if not runnable:
            return None, (
                f"this CPU ({platform.machine()}) has neither the AVX-512 nor the AVX2 set the native kernels need"
            )
        return runnable[0], f"picked from the CPU's flags (runnable here: {', '.join(runnable)})"
    if choice not in runnable:
        missing = [f for f in ISAS[choice].cpu_flags if f not in cpu_flags()]
        return None, (
            f"LOADMASTER_CPU_ISA={choice} was asked for, but this CPU lacks "
            f"{', '.join(missing) or 'x86-64 Linux'}; runnable here: {', '.join(runnable) or 'none'}"
        )
    return choice, f"forced by LOADMASTER_CPU_ISA={choice}"


def cache_dir() -> Path:
    """Where built kernels live: ``$LOADMASTER_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/loadmaster/kernels``."""
    return user_cache_path("kernels", "LOADMASTER_KERNEL_CACHE")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _compiler_identity(cc: str) -> str:
    """The compiler's resolved path, size and modification time: changes when it is upgraded, costs no process."""
    real = os.path.realpath(shutil.which(cc) or cc)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (KERNEL_DIR / name).read_bytes())
    return h.hexdigest()


def _flags(isa: str) -> list[str]:
    return [*_COMMON_CFLAGS, *ISAS[isa].cflags]


def _manifest(isa: str, compiler: str) -> BuildManifest:
    return BuildManifest(isa=isa, source_hash=source_hash(), cflags=_flags(isa), compiler=compiler)


def _stem(m: BuildManifest) -> str:
    src = hashlib.sha256(f"{m.source_hash}|{' '.join(m.cflags)}".encode()).hexdigest()[:16]
    cc = hashlib.sha256(m.compiler.encode()).hexdigest()[:8]
    return f"kernels-{m.isa}-{src}-{cc}"


def _valid(lib: Path, want: BuildManifest, any_compiler: bool) -> bool:
    try:
        got = BuildManifest(**json.loads(lib.with_suffix(".json").read_text()))
    except (OSError, ValueError, TypeError):
        return False
    same = (got.isa, got.source_hash, got.cflags) == (want.isa, want.source_hash, want.cflags)
    if not (lib.is_file() and same and (any_compiler or got.compiler == want.compiler)):
        return False
    try:
        image = lib.read_bytes()
    except OSError:
        return False
    if (len(image), hashlib.sha256(image).hexdigest()) != (got.size, got.sha256):
        log.warning("native CPU kernels: %s does not match its manifest (size or hash); rebuilding it", lib.name)
        return False
    return True


def _cached(isa: str, compiler: str | None) -> Path | None:
    """A valid library for this path: the one this compiler built, or (no compiler here) any built elsewhere."""
    if compiler is not None:
        want = _manifest(isa, _compiler_identity(compiler))
        lib = cache_dir() / f"{_stem(want)}.so"
        return lib if _valid(lib, want, any_compiler=False) else None
    want = _manifest(isa, "")
    prefix = _stem(want).rsplit("-", 1)[0]
    for lib in sorted(cache_dir().glob(f"{prefix}-*.so")):
        if _valid(lib, want, any_compiler=True):
            return lib
    return None


def build(isa: str, cc: str | None = None) -> Path:
    """Compile one path's library into the cache unless a valid one is there, and return its path.

    Needs no particular CPU (a library is only loaded where the CPU runs its path), so an image can build every
    path at build time. Raises ``RuntimeError`` when there is no compiler or the compiler fails.
    """
    if isa not in ISAS:
        raise ValueError(f"no instruction-set path {isa!r}; there are {', '.join(ISAS)}")
    cc = cc or _compiler()
    cached = _cached(isa, cc)
    if cached is not None:
        return cached
    if cc is None:
        raise RuntimeError(
            "no C compiler (cc, gcc or clang) on PATH to build the native kernels, and no library "
            f"built for these sources in {cache_dir()}"
        )
    manifest = _manifest(isa, _compiler_identity(cc))
    target = cache_dir() / f"{_stem(manifest)}.so"
    target.parent.mkdir(parents=True, exist_ok=True)

    def compile_to(tmp: str) -> None:
        proc = subprocess.run(
            [cc, *manifest.cflags, "-o", tmp, *(str(KERNEL_DIR / s) for s in SOURCES)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")

    log.info("building the native CPU kernels (%s) into %s", isa, target)
    replace_atomically(target, compile_to, mode=0o755)  # a library the runtime user must be able to load
    image = target.read_bytes()
    manifest = replace(manifest, size=len(image), sha256=hashlib.sha256(image).hexdigest())
    # The manifest goes last: a library without one is never loaded, so a crash between the two is harmless.
    write_text_atomically(target.with_suffix(".json"), json.dumps(asdict(manifest)))
    return target


def build_all(cc: str | None = None) -> list[Path]:
    """Every path built into the cache (what an image's build stage runs). A path the compiler cannot build (AMX
    with an old compiler) is left out with a warning; it raises only if no path builds."""
    built: list[Path] = []
    errors: list[str] = []
    for isa in ISAS:
        try:
            built.append(build(isa, cc))
        except RuntimeError as exc:
            errors.append(f"{isa}: {exc}")
            log.warning("native CPU kernels, %s path not built: %s", isa, exc)
    if not built:
        raise RuntimeError("no native kernel path could be built: " + "; ".join(errors))
    return built


def _load() -> tuple[KernelStatus, _Library | None]:
    try:
        isa, why = select_isa()
        auto = requested_isa() == "auto"
    except ValueError as exc:
        return KernelStatus(False, str(exc)), None
    if isa is None:
        return KernelStatus(False, why), None
    # Picked from the flags, a path whose build fails (a compiler too old for AMX, say) gives way to the next one
    # this CPU runs; a forced path does not.
    runnable = runnable_isas()
    candidates = runnable[runnable.index(isa) :] if auto and isa in runnable else [isa]
    failed: KernelStatus | None = None
    for candidate in candidates:
        try:
            path = build(candidate)
            lib = _Library(path, candidate)
        except RuntimeError as exc:
            if "no C compiler" in str(exc):
                return KernelStatus(False, str(exc), isa=candidate), None
            failed = KernelStatus(False, f"building the kernels failed: {exc}", isa=candidate)
        except (OSError, AttributeError, subprocess.SubprocessError) as exc:
            failed = KernelStatus(False, f"building or loading the kernels failed: {exc}", isa=candidate)
        else:
            note = "" if candidate == isa else f"; the {isa} path failed to build, so the next one runs"
            return KernelStatus(
                True, f"native kernels on the {candidate} path ({why}{note})", str(path), candidate
            ), lib
        log.warning("native CPU kernels, %s path: %s", candidate, failed.reason)
    return failed, None  # type: ignore[return-value]  # candidates is never empty


def _ensure() -> KernelStatus:
    st = _state.get("status")
    if st is None:
        with _lock:
            st = _state.get("status")
            if st is None:
                st, lib = _load()
                _state["lib"] = lib
                _state["status"] = st
                log.info("native CPU kernels: %s", st.reason)
    return st  # type: ignore[return-value]


def status(dtype: object = None) -> KernelStatus:
    """Build and load the kernels on first call; afterwards answer from memory. All kernels share one library,
    so ``dtype`` (kept for callers that ask per dtype) must only name a kernel that exists."""
    if dtype is not None and dtype not in KERNELS and dtype not in QUANT_KERNELS:
        raise ValueError(
            f"no native kernel for {dtype}; there are kernels for {sorted(map(str, KERNELS)) + sorted(QUANT_KERNELS)}"
        )
    return _ensure()


def current(dtype: object = None) -> KernelStatus | None:
    """The status if the kernels were already looked at, without building them (for reports)."""
    return _state.get("status")  # type: ignore[return-value]


def available(dtype: object = None) -> bool:
    return status(dtype).available


def function(name: str) -> ctypes._CFuncPtr:
    """The bound C function ``lm_<name>``; raises when the kernels are not loaded."""
    lib = _state.get("lib")
    if lib is None:
        raise RuntimeError(f"the native kernels are not loaded ({_ensure().reason})")
    return lib.fns[name]  # type: ignore[union-attr]


def reset() -> None:
    """Forget the loaded choice, so the next :func:`status` reads ``LOADMASTER_CPU_ISA`` again (tests, benches).
    A library stays mapped in the process; it is simply not called any more."""
    with _lock:
        _state.clear()
        for hook in _reset_hooks:
            hook()


def on_reset(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever :func:`reset` runs (for modules that cache bound functions)."""
    _reset_hooks.append(hook)
