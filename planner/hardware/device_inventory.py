"""The devices a plan may use: read from ``max_memory``, declared (``--gpus 4x24GiB``) or detected.

Order matters and is fixed: GPUs by id, then ``cpu``, then ``disk``. Overflow always walks that order.
Detection is the only place here that touches torch, and it imports it lazily: planning for declared
hardware never needs a GPU, or even torch.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.errors import HardwareSpecError, PlanError
from planner.hardware.devices import device_order, parse_device
from planner.hardware.units import format_bytes, parse_size
from planner.types import Device, DeviceId, Hardware

#: Bytes/s each kind of device reads its own memory at, and the rate its contents reach the execution device.
#: Deliberately round, middle-of-the-road figures; override them with ``bandwidths=``.
DEFAULT_BANDWIDTHS: dict[str, float] = {
    "gpu": 1.0e12,  # HBM/GDDR of a current data-centre or high-end consumer GPU
    "cpu": 2.0e10,  # host DRAM, a few channels
    "link": 2.5e10,  # host -> GPU over PCIe 4.0 x16 from pinned memory
    "disk": 2.0e9,  # NVMe sequential read
}
DEFAULT_GPU_RESERVE = 512 * 2**20  # CUDA context + allocator slack per GPU


@dataclass(frozen=True)
class HostPaths:
    """Where this machine's memory figures are read. Injectable so tests can point them at fake files."""

    meminfo: str = "/proc/meminfo"
    cgroup_root: str = "/sys/fs/cgroup"
    self_cgroup: str = "/proc/self/cgroup"
    #: This process's own status (``RssFile``: the libraries and files it has mapped and touched).
    self_status: str = "/proc/self/status"
    dev_dir: str = "/dev"
    nvidia_proc: str = "/proc/driver/nvidia"
    #: Where ``nvidia-smi`` is looked for; None means the process's ``PATH``.
    search_path: str | None = None
    #: ``CUDA_VISIBLE_DEVICES`` as this process sees it; None means read the environment.
    visible_devices: str | None = None


def parse_gpus(spec: str | list[int | str] | tuple[int | str, ...]) -> list[int]:
    """``"4x24GiB"``, ``"2x80GB,1x24GiB"``, ``"24GiB,48GiB"`` or a list of sizes -> capacities in bytes."""
    if isinstance(spec, (list, tuple)):
        return [parse_size(s) for s in spec]
    if not isinstance(spec, str) or not spec.strip():
        raise HardwareSpecError(f"cannot read GPU declaration {spec!r}; write e.g. '4x24GiB' or '2x80GB,1x24GiB'")
    sizes: list[int] = []
    for part in re.split(r"[,+]", spec):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*[x×*]\s*(.+)", part)
        count, size = (int(m.group(1)), m.group(2)) if m else (1, part)
        if count < 1:
            raise HardwareSpecError(f"GPU count in {part!r} must be at least 1")
        if count > 1024:
            raise HardwareSpecError(f"GPU count in {part!r} is implausible (over 1024)")
        try:
            sizes.extend([parse_size(size)] * count)
        except HardwareSpecError as e:
            raise HardwareSpecError(f"cannot read GPU declaration {spec!r}: {e}") from None
    return sizes


def gpu_evidence(paths: HostPaths) -> str | None:
    """What shows this machine has a GPU driver (NVIDIA's device nodes or ``nvidia-smi``, ROCm's ``/dev/kfd``), or
    None. Without any, torch would find no GPU either, and asking it costs seconds of import."""
    if os.path.exists(paths.nvidia_proc):
        return paths.nvidia_proc
    if os.path.exists(os.path.join(paths.dev_dir, "kfd")):
        return os.path.join(paths.dev_dir, "kfd")
    nodes = sorted(n for n in _listdir(paths.dev_dir) if n.startswith("nvidia") and n[6:].isdigit())
    if nodes:
        return os.path.join(paths.dev_dir, nodes[0])
    smi = shutil.which("nvidia-smi", path=paths.search_path if paths.search_path is not None else None)
    return f"{smi} on PATH" if smi else None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@dataclass(frozen=True)
class GpuDetection:
    """The GPUs found on this machine (id -> bytes the plan may use) and how their sizes were read."""

    capacities: dict[DeviceId, int]
    note: str | None = None


def _gpus_hidden_on_purpose(paths: HostPaths) -> bool:
    """``CUDA_VISIBLE_DEVICES=""`` (or ``-1``) hides every GPU deliberately: a CPU plan is then what was asked."""
    visible = paths.visible_devices if paths.visible_devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in ("", "-1")


def _cuda_failure(torch: Any) -> str:
    """Why torch cannot use the GPU this machine shows, in words a user can act on."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"the installed torch {torch.__version__} is a CPU-only build"
    try:
        torch.cuda.init()
    except Exception as e:  # the driver's own words: too old for the wheel, no device node permission...
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot initialise CUDA: {e}"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def _nvml_free(torch: Any, count: int) -> dict[int, int] | None:
    """Free bytes per torch device id from NVML (matched by UUID), which opens no CUDA context; None without NVML."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            free: dict[int, int] = {}
            for i in range(count):
                uuid = str(torch.cuda.get_device_properties(i).uuid)
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
                free[i] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
            return free
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # an NVML that disagrees with torch: fall back to the device properties
        return None


def detect_gpus(paths: HostPaths | None = None) -> GpuDetection:
    """The GPUs torch can use here. None when no GPU driver shows or the GPUs are hidden on purpose.

    Raises PlanError when the machine shows a GPU driver but torch cannot use it: planning CPU and disk only
    would load the model there and serve it a hundred times slower while reporting healthy. Sizes come from
    NVML's free memory or the device properties' total, never ``mem_get_info``, which opens a CUDA context (and
    its few hundred MiB) on every visible GPU, including those the plan will not use.
    """
    paths = paths or HostPaths()
    evidence = gpu_evidence(paths)
    if evidence is None or _gpus_hidden_on_purpose(paths):
        return GpuDetection({})
    try:
        import torch
    except ImportError:
        cause = "torch is not installed"
    else:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            count = torch.cuda.device_count()
            free = _nvml_free(torch, count)
            if free is not None:
                return GpuDetection(dict(free), f"GPU capacities are NVML's free memory on {count} GPU(s)")
            totals = {i: int(torch.cuda.get_device_properties(i).total_memory) for i in range(count)}
            return GpuDetection(
                dict(totals),
                f"GPU capacities are the total memory of {count} GPU(s) (memory other processes hold is not "
                "seen; install nvidia-ml-py to plan on free memory, or give max_memory)",
            )
        cause = _cuda_failure(torch)
    raise PlanError(
        f"this machine shows a GPU ({evidence}) but {cause}, so a plan for it would silently use only CPU and "
        "disk. Fix the driver or install a torch wheel built for it (e.g. pip install torch --index-url "
        "https://download.pytorch.org/whl/cu124), or declare the hardware: --gpus 1x24GiB / max_memory, "
        "e.g. {'cpu': '64GiB'} to plan without GPUs on purpose (or set CUDA_VISIBLE_DEVICES='')"
    )


def detect_memory(
    offload_folder: str | os.PathLike | None = None, gpus: bool = True, host: HostMemory | None = None
) -> dict[DeviceId, int]:
    """Free memory of each visible GPU (unless ``gpus=False``: they were declared), available RAM (``host``, or
    read from this machine), and free disk at the offload folder (if one is given)."""
    found: dict[DeviceId, int] = detect_gpus().capacities if gpus else {}
    found["cpu"] = (host or host_memory()).available
    if offload_folder is not None:
        found["disk"] = free_disk(offload_folder)
    return found


def free_disk(offload_folder: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``offload_folder``."""
    probe = os.fspath(offload_folder)
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return int(shutil.disk_usage(probe or ".").free)


#: A cgroup limit at or above this is "unlimited": v1 writes 2**63 rounded down to a page, not "max".
UNLIMITED_CGROUP_BYTES = 2**60


@dataclass(frozen=True)
class HostMemory:
    """RAM a plan may use on this host, and which bound set it: a container's limit can be far below what the
    kernel reports as available, and planning past it gets the process OOM-killed while loading."""

    available: int
    #: ``"MemAvailable"`` or the cgroup file that set the bound.
    bound: str
    reason: str


def read_mem_available(paths: HostPaths = HostPaths()) -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or None when it cannot be read."""
    try:
        with open(paths.meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_cgroup_dirs(paths: HostPaths) -> list[tuple[str, str]]:
    """(directory, version) candidates holding this process's memory controller, most specific first.

    Inside a container the cgroup namespace makes the own cgroup the root, so the root files are the usual hit;
    on a host the path comes from ``/proc/self/cgroup`` (``0::/path`` for v2, ``N:memory:/path`` for v1)."""
    dirs: list[tuple[str, str]] = []
    try:
        with open(paths.self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].lstrip("/")
        if parts[0] == "0" and parts[1] == "" and rel:
            dirs.append((os.path.join(paths.cgroup_root, rel), "v2"))
        elif "memory" in parts[1].split(",") and rel:
            dirs.append((os.path.join(paths.cgroup_root, "memory", rel), "v1"))
    dirs.append((paths.cgroup_root, "v2"))
    dirs.append((os.path.join(paths.cgroup_root, "memory"), "v1"))
    return dirs


@dataclass(frozen=True)
class ContainerLimit:
    """A cgroup memory limit, the file it came from, and what the processes in that cgroup already hold."""

    limit: int
    source: str
    #: Bytes the box already holds that a plan cannot use: the cgroup's anonymous memory (this process's
    #: interpreter, torch, tokenizer, and anything else running in the box) plus the files this process has mapped
    #: (torch's libraries: evicting them would only fault them back in).
    footprint: int
    footprint_source: str


def read_container_limit(paths: HostPaths = HostPaths()) -> ContainerLimit | None:
    """The container's memory limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``) and what is already
    held inside it, or None when there is no limit: no such file, ``max``, or a huge value."""
    for directory, version in _own_cgroup_dirs(paths):
        name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            continue
        if limit <= 0 or limit >= UNLIMITED_CGROUP_BYTES:
            return None
        footprint, how = _footprint(directory, version, paths)
        return ContainerLimit(limit, f"cgroup {version} {name}", footprint, how)
    return None


def _read_kv(path: str, unit: int = 1) -> dict[str, int]:
    """``key value`` (or ``key: value kB``) lines as integers times ``unit``; empty when the file cannot be read."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.replace(":", " ").split()
                if len(parts) >= 2 and parts[1].isdigit():
                    out[parts[0]] = int(parts[1]) * unit
    except OSError:
        pass
    return out


def _footprint(directory: str, version: str, paths: HostPaths) -> tuple[int, str]:
    """Measured, not guessed: the cgroup's anonymous memory (``memory.stat``: v2 ``anon``, v1 ``total_rss``) plus
    this process's mapped files (``RssFile``); this process's whole ``VmRSS`` where ``memory.stat`` is unreadable."""
    stat = _read_kv(os.path.join(directory, "memory.stat"))
    status = _read_kv(paths.self_status, unit=1024)
    key = "anon" if version == "v2" else ("total_rss" if "total_rss" in stat else "rss")
    if key in stat:
        mapped = status.get("RssFile", 0)
        return stat[
            key
        ] + mapped, f"the cgroup's {key} {format_bytes(stat[key])} + this process's mapped files {format_bytes(mapped)}"
    rss = status.get("VmRSS", 0)
    return rss, f"this process's VmRSS {format_bytes(rss)}"


def host_memory(paths: HostPaths = HostPaths()) -> HostMemory:
    """RAM the CPU may hold: the smaller of ``MemAvailable`` and what the container's memory limit leaves once what
    the box already holds (the process itself included) is taken off."""
    available = read_mem_available(paths)
    if available is None:
        try:
            available = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            available = 0
    box = read_container_limit(paths)
    left = None if box is None else max(box.limit - box.footprint, 0)
    if box is not None and left < available:
        return HostMemory(
            available=left,
            bound=box.source,
            reason=(
                f"cpu capacity {format_bytes(left)} is the container's memory limit {format_bytes(box.limit)} "
                f"({box.source}) less what the box already holds ({box.footprint_source}), below the host's "
                f"MemAvailable of {format_bytes(available)}"
            ),
        )
    why = f"cpu capacity {format_bytes(available)} is the host's MemAvailable"
    if box is not None:
        why += f" (the container's limit, {format_bytes(box.limit)} from {box.source}, leaves more)"
    return HostMemory(available=available, bound="MemAvailable", reason=why)


def build_hardware(
    max_memory: Mapping[Any, Any] | None = None,
    gpus: str | list[int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    gpu_reserve: int | str | None = None,
    bandwidths: Mapping[str, float] | None = None,
    host_paths: HostPaths | None = None,
) -> Hardware:
    """Resolve what the plan may use.

    - ``max_memory`` given: exactly the devices it names, with those budgets (as accelerate does), and the free
      disk at ``offload_folder`` where it names no disk (given a folder, disk is usable, whatever else is
      declared). Declared ``gpus`` are added for ids it does not name.
    - only ``gpus`` given: those GPUs, plus this machine's available RAM as ``cpu`` and, with an offload folder,
      its free disk.
    - neither: everything detected on this machine.

    Where the CPU's capacity is read from this machine, ``notes`` says which bound set it (MemAvailable or the
    container's memory limit), and how detected GPUs were sized; ``host_paths`` points those reads elsewhere
    (tests). A GPU driver that torch cannot use raises PlanError (see :func:`detect_gpus`).
    """
    bw = dict(DEFAULT_BANDWIDTHS)
    for k, v in (bandwidths or {}).items():
        if k not in bw:
            raise HardwareSpecError(f"unknown bandwidth kind {k!r}; use one of {sorted(bw)}")
        if not isinstance(v, (int, float)) or v <= 0:
            raise HardwareSpecError(f"bandwidth {k}={v!r} must be a positive number of bytes/s")
        bw[k] = float(v)
    reserve = DEFAULT_GPU_RESERVE if gpu_reserve is None else parse_size(gpu_reserve)

    capacities: dict[DeviceId, int] = {}
    notes: list[str] = []
    source = "max_memory"
    if gpus is not None:
        for i, size in enumerate(parse_gpus(gpus)):
            capacities[i] = size
        source = "declared"
    if max_memory is not None:
        if not isinstance(max_memory, Mapping):
            raise HardwareSpecError(
                f"max_memory must be a mapping of device to size, e.g. {{0: '20GiB', 'cpu': '64GiB'}}; got {max_memory!r}"
            )
        if not max_memory:
            raise HardwareSpecError("max_memory is empty; name at least one device, e.g. {'cpu': '16GiB'}")
        for key, value in max_memory.items():
            dev = parse_device(key)
            try:
                capacities[dev] = parse_size(value)
            except HardwareSpecError as e:
                raise HardwareSpecError(f"max_memory[{key!r}]: {e}") from None
        if offload_folder is not None and "disk" not in capacities:
            capacities["disk"] = free_disk(offload_folder)  # the folder makes disk usable, as its flag says
    elif gpus is not None:
        host = host_memory(host_paths or HostPaths())
        notes.append(host.reason)
        detected = detect_memory(offload_folder, gpus=False, host=host)
        capacities["cpu"] = detected["cpu"]
        if "disk" in detected:
            capacities["disk"] = detected["disk"]
    else:
        host_paths = host_paths or HostPaths()
        found = detect_gpus(host_paths)
        host = host_memory(host_paths)
        notes += [n for n in (found.note, host.reason) if n]
        capacities = dict(found.capacities)
        capacities.update(detect_memory(offload_folder, gpus=False, host=host))
        source = "detected"

    devices = []
    for dev in sorted(capacities, key=device_order):
        kind = "gpu" if isinstance(dev, int) else str(dev)
        if kind == "gpu":
            own, link = bw["gpu"], bw["gpu"]
        elif kind == "cpu":
            own, link = bw["cpu"], min(bw["cpu"], bw["link"])
        else:
            own, link = bw["disk"], bw["disk"]
        devices.append(Device(id=dev, capacity=capacities[dev], bandwidth=own, link_bandwidth=link))
    return Hardware(
        devices=tuple(devices),
        gpu_reserve=reserve,
        source=source,
        storage_bandwidth=bw["disk"],
        link_bandwidth=bw["link"],
        notes=tuple(notes),
    )
