"""Native CPU kernels for decode-time linear layers, built on first use and loaded with ctypes.

Why native code: at decode time a bfloat16 linear layer is a matrix-vector product whose speed is the memory
bandwidth it reaches. torch's CPU bf16 path reaches about half of it; ``kernels/linear_bf16.c`` reads the weight
rows in place with AVX512-BF16 dot products and gets close to the streaming rate. Because it reads the weight
where it lies, a weight that is a view of a safetensors file mapping (a ``"disk"`` block) stays zero-copy.

Why ctypes and not a torch extension: the C file includes no torch header, so it builds in about a second with
the system C compiler and needs no build step at install time. The build goes to a cache keyed by the source's
hash and the compiler flags, written to a temporary name and renamed, so concurrent first uses (several test
workers, several servers) never see a half-written library. :func:`build` can also run ahead of time (the Docker
image's build stage does), so a machine without a compiler can still use a library built elsewhere. ``-fopenmp`` binds to the OpenMP runtime torch
already loaded (same soname), so the kernel shares torch's thread pool instead of starting a second one.

Everything degrades to torch: no compiler, a CPU without ``avx512_bf16``, a failed build, or
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

SOURCE = Path(__file__).resolve().parent / "kernels" / "linear_bf16.c"
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
#: Rows of activations up to which the kernel is used; beyond it (prefill) the GEMM is compute-bound and
#: torch's blocked kernels are the better choice.
MAX_ROWS = 8


@dataclass(frozen=True)
class KernelStatus:
    """Whether the native kernels are in use, and if not, why (for logs, ``/info`` and tests)."""

    available: bool
    reason: str
    library: Optional[str] = None


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_status: Optional[KernelStatus] = None


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


def library_path() -> Path:
    """Where the built library for this source and these flags lives (the compiler does not enter the key, so a
    library built elsewhere, e.g. in a Docker build stage, is used where no compiler is installed)."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"linear_bf16-{key}.so"


def build(cc: Optional[str] = None) -> Path:
    """Compile the kernel into the cache unless it is there already, and return the library's path.

    Needs no particular CPU (the library is only loaded where the CPU has the instructions), so an image can
    build it once at build time. Raises ``RuntimeError`` when there is no compiler or the compiler fails.
    """
    target = library_path()
    if target.exists():
        return target
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH to build the kernel")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it 0600: other users (an image's runtime user) must be able to load it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> KernelStatus:
    global _lib
    if os.environ.get("LOADMASTER_CPU_KERNELS", "auto").lower() == "torch":
        return KernelStatus(False, "disabled by LOADMASTER_CPU_KERNELS=torch")
    if not sys.platform.startswith("linux"):
        return KernelStatus(False, f"native kernels are built for Linux only (this is {sys.platform})")
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return KernelStatus(False, f"this CPU lacks {', '.join(missing)}")
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
        fn = lib.lm_linear_bf16
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    except RuntimeError as exc:
        return KernelStatus(False, str(exc) if "no C compiler" in str(exc) else f"building the kernel failed: {exc}")
    except (OSError, subprocess.SubprocessError) as exc:
        return KernelStatus(False, f"building or loading the kernel failed: {exc}")
    _lib = lib
    return KernelStatus(True, "avx512_bf16 kernel in use", str(path))


def status() -> KernelStatus:
    """Build and load the kernel on first call; afterwards answer from memory."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _load()
                log.info("native CPU kernels: %s", _status.reason)
    return _status


def current() -> Optional[KernelStatus]:
    """The status if the kernel was already looked at, without building it (for reports)."""
    return _status


def available() -> bool:
    return status().available


_BF16 = torch.bfloat16


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear_bf16` takes these operands (a decode-sized bf16 product on the CPU).

    Called once per linear layer per token, so it reads only cheap attributes (``is_cpu``, not ``device``).
    """
    if x.dtype is not _BF16 or weight.dtype is not _BF16 or not x.is_cpu or not weight.is_cpu:
        return False
    shape = x.shape
    k = shape[-1]
    if weight.dim() != 2 or weight.stride(1) != 1 or k != weight.shape[1] or k == 0:
        return False
    if not 0 < x.numel() // k <= MAX_ROWS:
        return False
    return not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled())


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the native kernel. Callers check :func:`supports` and :func:`available`."""
    lib = _lib
    if lib is None:
        raise RuntimeError("the native bf16 kernel is not loaded; call loaders.cpu_kernels.status() first")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=_BF16)
    bias_ptr = None
    if bias is not None:
        if bias.dtype is not _BF16 or not bias.is_contiguous():
            bias = bias.to(_BF16).contiguous()
        bias_ptr = bias.data_ptr()
    rc = lib.lm_linear_bf16(x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0), bias_ptr,
                            out.data_ptr(), n, m, n, k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lm_linear_bf16 rejected shapes x={tuple(x.shape)} weight={tuple(weight.shape)}")
    if x.dim() == 2:
        return out
    return out.view(*x.shape[:-1], n)
