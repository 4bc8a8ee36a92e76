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
from typing import Any

from planner.devices import device_order, parse_device
from planner.errors import HardwareSpecError
from planner.types import Device, DeviceId, Hardware
from planner.units import parse_size

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


def detect_memory(offload_folder: str | os.PathLike | None = None, gpus: bool = True) -> dict[DeviceId, int]:
    """Free memory of each visible GPU (unless ``gpus=False``: they were declared), available RAM, and free disk at
    the offload folder (if one is given)."""
    found: dict[DeviceId, int] = detect_gpus() if gpus else {}
    found["cpu"] = _available_ram()
    if offload_folder is not None:
        folder = os.fspath(offload_folder)
        probe = folder
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        found["disk"] = int(shutil.disk_usage(probe or ".").free)
    return found


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 0


def build_hardware(
    max_memory: Mapping[Any, Any] | None = None,
    gpus: str | list[int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    gpu_reserve: int | str | None = None,
    bandwidths: Mapping[str, float] | None = None,
) -> Hardware:
    """Resolve what the plan may use.

    - ``max_memory`` given: exactly the devices it names, with those budgets (as accelerate does). Declared
      ``gpus`` are added for ids it does not name.
    - only ``gpus`` given: those GPUs, plus this machine's available RAM as ``cpu`` and, with an offload folder,
      its free disk.
    - neither: everything detected on this machine.
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
        detected = detect_memory(offload_folder, gpus=False)
        capacities["cpu"] = detected["cpu"]
        if "disk" in detected:
            capacities["disk"] = detected["disk"]
    else:
        capacities = dict(detect_memory(offload_folder))
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
    )
