"""What a bug report needs to know about this machine: ``loadmaster env`` (a table, or JSON with ``--json``).

GPUs and the links between them, the CPU and the instruction sets the native kernels use (and which kernels
load), RAM and free disk at the offload folder, the versions of everything that matters, whether bitsandbytes
works here, and the ``LOADMASTER_*`` settings in force with secrets masked. Each probe that fails says why in
its field instead of failing the report: the report is most needed on machines where something is broken.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from planner.hardware.calibration import calibration_path, cpu_model_name, load_calibration
from planner.hardware.units import format_bytes

log = logging.getLogger(__name__)

#: Instruction-set flags worth reporting: those the native kernels need, and their neighbours.
REPORTED_CPU_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)
#: Setting names whose values are secrets.
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
PACKAGES = (
    "torch",
    "transformers",
    "safetensors",
    "tokenizers",
    "accelerate",
    "bitsandbytes",
    "fastapi",
    "uvicorn",
    "pydantic",
    "loadmaster",
)


@dataclass
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int | None
    compute_capability: str
    #: Other GPU indices this one can read directly (peer access); the rest go through host memory.
    peers: list[int] = field(default_factory=list)


@dataclass
class IsaInfo:
    """One instruction-set path the native kernels are built for, and whether this CPU runs it."""

    name: str
    cpu_flags_needed: list[str]
    cpu_flags_missing: list[str]
    runnable: bool


@dataclass
class KernelInfo:
    """One native kernel (bf16, fp32, int8, int4 linear) and whether it runs here."""

    name: str
    weights: str
    available: bool


@dataclass
class EnvReport:
    platform: str
    python: str
    versions: dict[str, str | None]
    cuda: str | None
    gpus: list[GpuInfo]
    gpu_note: str
    cpu_model: str
    cpu_cores: int | None
    cpu_cores_usable: int | None
    torch_threads: int | None
    cpu_flags: list[str]
    kernel_isas: list[IsaInfo]
    #: The path in use (``avx512``, ``avx2``) or None where torch's kernels run, and why.
    kernel_path: str | None
    kernel_reason: str
    kernels: list[KernelInfo]
    ram_total_bytes: int | None
    ram_available_bytes: int | None
    offload_folder: str
    disk_free_bytes: int | None
    bitsandbytes_works: bool
    bitsandbytes_detail: str
    settings: dict[str, str]
    calibration: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    return cpu_model_name() or platform.processor() or "unknown"


def _meminfo() -> tuple[int | None, int | None]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    values[name] = int(parts[0]) * 1024
    except OSError:
        return None, None
    return values.get("MemTotal"), values.get("MemAvailable")


def _disk_free(folder: Path) -> int | None:
    """Free bytes on the filesystem that holds ``folder`` (or its nearest existing parent)."""
    probe = folder.expanduser().resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def mask_settings(environ: dict[str, str]) -> dict[str, str]:
    """The ``LOADMASTER_*`` variables, with secret values (API keys, tokens) replaced by a mask per item."""
    out: dict[str, str] = {}
    for name in sorted(environ):
        if not name.startswith("LOADMASTER_"):
            continue
        value = environ[name]
        if any(marker in name for marker in SECRET_MARKERS):
            items = [v for v in value.split(",") if v.strip()]
            value = ",".join("***" for _ in items) + f" ({len(items)} set)" if items else "(empty)"
        out[name] = value
    return out


def _gpus(torch: Any) -> tuple[list[GpuInfo], str]:
    if not torch.cuda.is_available():
        return [], "no CUDA GPU visible to torch" + ("" if torch.version.cuda else " (a CPU-only torch build)")
    gpus = []
    count = torch.cuda.device_count()
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        try:
            free, _ = torch.cuda.mem_get_info(i)
        except RuntimeError:
            free = None
        peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
        gpus.append(
            GpuInfo(
                index=i,
                name=props.name,
                total_bytes=int(props.total_memory),
                free_bytes=free,
                compute_capability=f"{props.major}.{props.minor}",
                peers=peers,
            )
        )
    return gpus, f"{count} CUDA GPU(s)"


def _kernels(flags: set[str]) -> tuple[list[IsaInfo], str | None, str, list[KernelInfo]]:
    from loaders.native import kernel_build

    isas = [
        IsaInfo(
            name=name,
            cpu_flags_needed=list(isa.cpu_flags),
            cpu_flags_missing=[f for f in isa.cpu_flags if f not in flags],
            runnable=name in kernel_build.runnable_isas(),
        )
        for name, isa in kernel_build.ISAS.items()
    ]
    st = kernel_build.status()
    kernels = [
        KernelInfo(name=k.name, weights=str(d).removeprefix("torch."), available=st.available)
        for d, k in kernel_build.KERNELS.items()
    ]
    kernels += [
        KernelInfo(name=k.name, weights=scheme, available=st.available)
        for scheme, k in kernel_build.QUANT_KERNELS.items()
    ]
    return isas, st.isa if st.available else None, st.reason, kernels


def bitsandbytes_check(torch: Any) -> tuple[bool, str]:
    """Quantize and dequantize a small tensor with bitsandbytes on the device it would run on here."""
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf
    except Exception as exc:  # an import that fails for any reason is the answer
        return False, f"import failed: {type(exc).__name__}: {exc}"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        x = torch.linspace(-1, 1, 256, device=device)
        q, state = bnbf.quantize_4bit(x, quant_type="nf4")
        back = bnbf.dequantize_4bit(q, state)
        err = float((back.float() - x).abs().max())
        if err > 0.2:
            return False, f"nf4 round trip on {device} is off by {err:.3f}"
    except Exception as exc:
        return (
            False,
            f"bitsandbytes {bitsandbytes.__version__} imports, but nf4 on {device} fails: {type(exc).__name__}: {exc}",
        )
    return True, f"bitsandbytes {bitsandbytes.__version__}: nf4 quantize/dequantize on {device} works"


def collect(offload_folder: str | os.PathLike | None = None, environ: dict[str, str] | None = None) -> EnvReport:
    """Probe this machine. Needs torch (and imports the native-kernel loader, which may build the kernels)."""
    import torch

    from loaders.native import kernel_build

    env = dict(os.environ if environ is None else environ)
    folder = Path(offload_folder or env.get("LOADMASTER_OFFLOAD_FOLDER") or Path.cwd())
    flags = kernel_build.cpu_flags()
    gpus, gpu_note = _gpus(torch)
    isas, kernel_path, kernel_reason, kernels = _kernels(flags)
    total, available = _meminfo()
    works, detail = bitsandbytes_check(torch)
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    path = calibration_path(env)
    cal = load_calibration(path)
    return EnvReport(
        platform=platform.platform(),
        python=platform.python_version(),
        versions={p: _version(p) for p in PACKAGES},
        cuda=torch.version.cuda,
        gpus=gpus,
        gpu_note=gpu_note,
        cpu_model=_cpu_model(),
        cpu_cores=os.cpu_count(),
        cpu_cores_usable=usable,
        torch_threads=torch.get_num_threads(),
        cpu_flags=[f for f in REPORTED_CPU_FLAGS if f in flags],
        kernel_isas=isas,
        kernel_path=kernel_path,
        kernel_reason=kernel_reason,
        kernels=kernels,
        ram_total_bytes=total,
        ram_available_bytes=available,
        offload_folder=str(folder),
        disk_free_bytes=_disk_free(folder),
        bitsandbytes_works=works,
        bitsandbytes_detail=detail,
        settings=mask_settings(env),
        calibration={
            "path": str(path) if path else None,
            "present": cal is not None,
            "summary": cal.summary() if cal else None,
        },
    )


def _size(n: int | None) -> str:
    return "unknown" if n is None else format_bytes(n)


def format_report(r: EnvReport) -> str:
    """The report as a two-column table for people (and bug reports)."""
    rows: list[tuple[str, str]] = [
        ("loadmaster", r.versions.get("loadmaster") or "not installed"),
        ("platform", r.platform),
        ("python", r.python),
    ]
    rows += [(p, v or "not installed") for p, v in r.versions.items() if p != "loadmaster"]
    rows.append(("CUDA (torch build)", r.cuda or "none (CPU build)"))
    rows.append(("GPUs", r.gpu_note))
    for g in r.gpus:
        free = f", {_size(g.free_bytes)} free" if g.free_bytes is not None else ""
        peers = ", peer access to " + ",".join(map(str, g.peers)) if g.peers else ", no peer access"
        rows.append(
            (f"  GPU {g.index}", f"{g.name}, {_size(g.total_bytes)}{free}, compute {g.compute_capability}{peers}")
        )
    rows.append(("CPU", r.cpu_model))
    rows.append(("cores", f"{r.cpu_cores} ({r.cpu_cores_usable} usable here, torch uses {r.torch_threads} threads)"))
    rows.append(("instruction sets", " ".join(r.cpu_flags) or "none of the reported ones"))
    for isa in r.kernel_isas:
        missing = f"; missing {' '.join(isa.cpu_flags_missing)}" if isa.cpu_flags_missing else ""
        rows.append(
            (
                f"kernel path {isa.name}",
                f"{'runs here' if isa.runnable else 'cannot run here'} "
                f"(needs {' '.join(isa.cpu_flags_needed)}{missing})",
            )
        )
    in_use = f"path {r.kernel_path}" if r.kernel_path else "not in use (torch's kernels run)"
    rows.append(("native kernels", f"{in_use}: {r.kernel_reason}"))
    for k in r.kernels:
        rows.append((f"kernel {k.weights}", f"{k.name}, {'available' if k.available else 'not available'}"))
    rows.append(("RAM", f"{_size(r.ram_total_bytes)} total, {_size(r.ram_available_bytes)} available"))
    rows.append(("disk free", f"{_size(r.disk_free_bytes)} at {r.offload_folder}"))
    rows.append(("bitsandbytes works", f"{'yes' if r.bitsandbytes_works else 'no'}: {r.bitsandbytes_detail}"))
    cal = r.calibration
    rows.append(
        (
            "calibration",
            f"{cal['summary']} ({cal['path']})"
            if cal["present"]
            else f"none (run 'loadmaster env --calibrate'; would be saved to {cal['path']})",
        )
    )
    if r.settings:
        for name, value in r.settings.items():
            rows.append((name, value))
    else:
        rows.append(("LOADMASTER_* settings", "none set"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
