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

from planner.devices import device_order, parse_device
from planner.errors import HardwareSpecError
from planner.types import Device, DeviceId, Hardware
from planner.units import format_bytes, parse_size

#: Bytes/s each kind of device reads its own memory at, and the rate its contents reach the execution device.
#: Deliberately round, middle-of-the-road figures; override them with ``bandwidths=``.
DEFAULT_BANDWIDTHS: dict[str, float] = {
    "gpu": 1.0e12,  # HBM/GDDR of a current data-centre or high-end consumer GPU
    "cpu": 2.0e10,  # host DRAM, a few channels
    "link": 2.5e10,  # host -> GPU over PCIe 4.0 x16 from pinned memory
    "disk": 2.0e9,  # NVMe sequential read
}
DEFAULT_GPU_RESERVE = 512 * 2**20  # CUDA context + allocator slack per GPU


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


def _gpu_driver_present() -> bool:
    """Whether this machine shows a GPU driver (NVIDIA's, or ROCm's ``/dev/kfd``) at all. Without one torch would
    find no GPU either, and asking it costs seconds of import; with one, torch is asked."""
    return (
        os.path.exists("/proc/driver/nvidia")
        or os.path.exists("/dev/kfd")
        or any(name.startswith("nvidia") and name[6:].isdigit() for name in _listdir("/dev"))
    )


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def detect_gpus() -> dict[DeviceId, int]:
    """Free memory of each GPU torch can see (none when torch is not installed or no GPU driver is present)."""
    found: dict[DeviceId, int] = {}
    if not _gpu_driver_present():
        return found
    try:
        import torch
    except ImportError:  # planning without torch: CPU and disk only
        return found
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, _total = torch.cuda.mem_get_info(i)
            found[i] = int(free)
    return found


def detect_memory(
    offload_folder: str | os.PathLike | None = None, gpus: bool = True, host: HostMemory | None = None
) -> dict[DeviceId, int]:
    """Free memory of each visible GPU (unless ``gpus=False``: they were declared), available RAM (``host``, or
    read from this machine), and free disk at the offload folder (if one is given)."""
    found: dict[DeviceId, int] = detect_gpus() if gpus else {}
    found["cpu"] = (host or host_memory()).available
    if offload_folder is not None:
        folder = os.fspath(offload_folder)
        probe = folder
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        found["disk"] = int(shutil.disk_usage(probe or ".").free)
    return found


#: A cgroup limit at or above this is "unlimited": v1 writes 2**63 rounded down to a page, not "max".
UNLIMITED_CGROUP_BYTES = 2**60


@dataclass(frozen=True)
class HostPaths:
    """Where this machine's memory figures are read. Injectable so tests can point them at fake files."""

    meminfo: str = "/proc/meminfo"
    cgroup_root: str = "/sys/fs/cgroup"
    self_cgroup: str = "/proc/self/cgroup"


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


def read_container_limit(paths: HostPaths = HostPaths()) -> tuple[int, str] | None:
    """The container's memory limit in bytes and the file it came from (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None when there is no limit: no such file, ``max``, or a huge value."""
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
        return limit, f"cgroup {version} {name}"
    return None


def host_memory(paths: HostPaths = HostPaths()) -> HostMemory:
    """RAM the CPU may hold: the smaller of ``MemAvailable`` and the container's memory limit."""
    available = read_mem_available(paths)
    if available is None:
        try:
            available = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            available = 0
    limit = read_container_limit(paths)
    if limit is not None and limit[0] < available:
        return HostMemory(
            available=limit[0],
            bound=limit[1],
            reason=(
                f"cpu capacity {format_bytes(limit[0])} is the container's memory limit ({limit[1]}), "
                f"below the host's MemAvailable of {format_bytes(available)}"
            ),
        )
    why = f"cpu capacity {format_bytes(available)} is the host's MemAvailable"
    if limit is not None:
        why += f" (the container's limit, {format_bytes(limit[0])} from {limit[1]}, is higher)"
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

    - ``max_memory`` given: exactly the devices it names, with those budgets (as accelerate does). Declared
      ``gpus`` are added for ids it does not name.
    - only ``gpus`` given: those GPUs, plus this machine's available RAM as ``cpu`` and, with an offload folder,
      its free disk.
    - neither: everything detected on this machine.

    Where the CPU's capacity is read from this machine, ``notes`` says which bound set it (MemAvailable or the
    container's memory limit); ``host_paths`` points those reads elsewhere (tests).
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
    elif gpus is not None:
        host = host_memory(host_paths or HostPaths())
        notes.append(host.reason)
        detected = detect_memory(offload_folder, gpus=False, host=host)
        capacities["cpu"] = detected["cpu"]
        if "disk" in detected:
            capacities["disk"] = detected["disk"]
    else:
        host = host_memory(host_paths or HostPaths())
        notes.append(host.reason)
        capacities = dict(detect_memory(offload_folder, host=host))
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
