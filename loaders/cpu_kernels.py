"""Native CPU kernels for decode-time linear layers, built on first use and loaded with ctypes.

Why native code: at decode time a linear layer multiplies one row (or a few) by its weight matrix, which is read
once per token, so its speed is the memory bandwidth it reaches. torch's CPU paths reach about half of it for
bfloat16, and for float32 MKL's small-M path reaches a quarter to a half. ``kernels/linear_bf16.c`` (AVX512-BF16
dot products) and ``kernels/linear_f32.c`` (AVX-512 fused multiply-adds) read the weight rows in place, 64 bytes
at a time, and get close to the streaming rate. Because they read a weight where it lies, a weight that is a view
of a safetensors file mapping (a ``"disk"`` block) stays zero-copy.

Why ctypes and not a torch extension: the C files include no torch header, so each builds in about a second with
the system C compiler and needs no build step at install time. A build goes to a cache keyed by the source's hash
and the compiler flags, written to a temporary name and renamed, so concurrent first uses (several test workers,
several servers) never see a half-written library. :func:`build_all` can also run ahead of time (the Docker
image's build stage does), so a machine without a compiler can use libraries built elsewhere. ``-fopenmp`` binds
to the OpenMP runtime torch already loaded (same soname), so the kernels share torch's threads.

Everything degrades to torch, per kernel: no compiler, a CPU without the instructions, a failed build, or
``LOADMASTER_CPU_KERNELS=torch`` in the environment. :func:`status` says which and why.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
_COMMON_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class Kernel:
    """One native linear kernel: its C source, what it needs from the CPU, and how many rows it takes."""

    name: str
    dtype: torch.dtype
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    #: Rows of activations up to which the kernel beats torch here (decode steps and small batches); beyond it
    #: the product is compute-bound and torch's blocked GEMM is the better choice.
    max_rows: int

    @property
    def source(self) -> Path:
        return KERNEL_DIR / f"{self.name}.c"

    @property
    def symbol(self) -> str:
        return f"lm_{self.name}"


KERNELS: dict[torch.dtype, Kernel] = {
    torch.bfloat16: Kernel("linear_bf16", torch.bfloat16, ("-mavx512f", "-mavx512bw", "-mavx512bf16"),
                           ("avx512f", "avx512bw", "avx512_bf16"), max_rows=32),
    torch.float32: Kernel("linear_f32", torch.float32, ("-mavx512f",), ("avx512f",), max_rows=32),
}


@dataclass(frozen=True)
class KernelStatus:
    """Whether a native kernel is in use, and if not, why (for logs, ``/info`` and tests)."""

    available: bool
    reason: str
    library: Optional[str] = None


_lock = threading.Lock()
_fns: dict[torch.dtype, ctypes._CFuncPtr] = {}
_status: dict[torch.dtype, KernelStatus] = {}


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


def cache_dir() -> Path:
    """Where built kernels live: ``$LOADMASTER_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/loadmaster/kernels``."""
    env = os.environ.get("LOADMASTER_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(base) / "loadmaster" / "kernels"


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _kernel(dtype: torch.dtype) -> Kernel:
    try:
        return KERNELS[dtype]
    except KeyError:
        raise ValueError(f"no native kernel for {dtype}; there are kernels for {sorted(map(str, KERNELS))}") from None


def library_path(dtype: torch.dtype = torch.bfloat16) -> Path:
    """Where the built library for this kernel's source and flags lives. The compiler does not enter the key, so
    a library built elsewhere (an image's build stage) is used where no compiler is installed."""
    k = _kernel(dtype)
    key = hashlib.sha256(k.source.read_bytes() + " ".join(_COMMON_CFLAGS + k.cflags).encode()).hexdigest()[:16]
    return cache_dir() / f"{k.name}-{key}.so"


def build(dtype: torch.dtype = torch.bfloat16, cc: Optional[str] = None) -> Path:
    """Compile one kernel into the cache unless it is there already, and return the library's path.

    Needs no particular CPU (a library is only loaded where the CPU has its instructions), so an image can build
    it once at build time. Raises ``RuntimeError`` when there is no compiler or the compiler fails.
    """
    k = _kernel(dtype)
    target = library_path(dtype)
    if target.exists():
        return target
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH to build the kernel")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_COMMON_CFLAGS, *k.cflags, "-o", tmp, str(k.source)], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it 0600: other users (an image's runtime user) must be able to load it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_all(cc: Optional[str] = None) -> list[Path]:
    """Every kernel built into the cache (what an image's build stage runs)."""
    return [build(dtype, cc) for dtype in KERNELS]


def _load(dtype: torch.dtype) -> KernelStatus:
    k = _kernel(dtype)
    if os.environ.get("LOADMASTER_CPU_KERNELS", "auto").lower() == "torch":
        return KernelStatus(False, "disabled by LOADMASTER_CPU_KERNELS=torch")
    if not sys.platform.startswith("linux"):
        return KernelStatus(False, f"native kernels are built for Linux only (this is {sys.platform})")
    missing = [f for f in k.cpu_flags if f not in cpu_flags()]
    if missing:
        return KernelStatus(False, f"this CPU lacks {', '.join(missing)}")
    try:
        path = build(dtype)
        fn = getattr(ctypes.CDLL(str(path)), k.symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    except RuntimeError as exc:
        return KernelStatus(False, str(exc) if "no C compiler" in str(exc) else f"building the kernel failed: {exc}")
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        return KernelStatus(False, f"building or loading the kernel failed: {exc}")
    _fns[dtype] = fn
    return KernelStatus(True, f"{k.name} kernel in use ({'+'.join(k.cpu_flags)})", str(path))


def status(dtype: torch.dtype = torch.bfloat16) -> KernelStatus:
    """Build and load the kernel for ``dtype`` on first call; afterwards answer from memory."""
    st = _status.get(dtype)
    if st is None:
        with _lock:
            st = _status.get(dtype)
            if st is None:
                st = _status[dtype] = _load(dtype)
                log.info("native CPU kernel for %s: %s", str(dtype).removeprefix("torch."), st.reason)
    return st


def current(dtype: torch.dtype = torch.bfloat16) -> Optional[KernelStatus]:
    """The status if the kernel was already looked at, without building it (for reports)."""
    return _status.get(dtype)


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    return status(dtype).available


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes these operands: a small product on the CPU in a dtype whose kernel is loaded.

    Called once per linear layer per token, so it reads only cheap attributes (``is_cpu``, not ``device``).
    """
    dtype = weight.dtype
    if x.dtype is not dtype or dtype not in _fns or not x.is_cpu or not weight.is_cpu:
        return False
    shape = x.shape
    k = shape[-1]
    if weight.dim() != 2 or weight.stride(1) != 1 or k != weight.shape[1] or k == 0:
        return False
    if not 0 < x.numel() // k <= KERNELS[dtype].max_rows:
        return False
    return not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the native kernel of ``weight``'s dtype. Callers check :func:`supports`."""
    dtype = weight.dtype
    fn = _fns.get(dtype)
    if fn is None:
        raise RuntimeError(f"the native {dtype} kernel is not loaded; call loaders.cpu_kernels.status({dtype}) first")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=dtype)
    bias_ptr = None
    if bias is not None:
        if bias.dtype is not dtype or not bias.is_contiguous():
            bias = bias.to(dtype).contiguous()
        bias_ptr = bias.data_ptr()
    rc = fn(x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0), bias_ptr, out.data_ptr(), n, m, n, k,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{KERNELS[dtype].symbol} rejected shapes x={tuple(x.shape)} weight={tuple(weight.shape)}")
    if x.dim() == 2:
        return out
    return out.view(*x.shape[:-1], n)
