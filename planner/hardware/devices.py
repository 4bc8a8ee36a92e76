"""One spelling of a device: every accepted input read to the canonical id, and every label made from it.

The canonical id is what transformers' ``hf_device_map`` holds: a GPU index (``0``, ``1``, ...), ``"cpu"`` or
``"disk"``. Users write more than that (``"0"``, ``"gpu0"``, ``"GPU 0"``, ``"cuda:0"``, a ``torch.device``), and
outputs need three renderings of it: a label for people (``GPU 0``), a string key for JSON objects and metrics
(``"0"``), and the name torch gives the device (``cuda:0``). Each is made here and nowhere else.

No torch import: a ``torch.device`` is read through its ``type`` and ``index`` attributes.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from planner.errors import HardwareSpecError
from planner.types import DeviceId

CPU = "cpu"
DISK = "disk"

_GPU_RE = re.compile(r"(?:cuda:|gpu:?\s*)?(\d+)")
_SPELLINGS = "a GPU index (0, '0', 'gpu0', 'GPU 0', 'cuda:0'), 'cpu' or 'disk'"


def parse_device(value: Any) -> DeviceId:
    """The canonical id of any accepted spelling; anything else is a :class:`HardwareSpecError` with a hint."""
    if isinstance(value, bool):
        raise HardwareSpecError(f"device {value!r} is a boolean; use {_SPELLINGS}")
    if isinstance(value, int):
        if value < 0:
            raise HardwareSpecError(f"GPU index {value} is negative; GPU indices start at 0: use {_SPELLINGS}")
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if key in (CPU, DISK):
            return key
        if key in ("cuda", "gpu"):
            return 0
        m = _GPU_RE.fullmatch(key)
        if m:
            return int(m.group(1))
        hint = difflib.get_close_matches(key, [CPU, DISK, "cuda:0"], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise HardwareSpecError(f"unknown device {value!r}{extra}; use {_SPELLINGS}")
    kind, index = getattr(value, "type", None), getattr(value, "index", None)
    if isinstance(kind, str):  # a torch.device
        if kind == "cuda":
            return parse_device(index or 0)
        if kind == CPU:
            return CPU
        raise HardwareSpecError(f"device {value!r} is not one loadmaster places weights on; use {_SPELLINGS}")
    raise HardwareSpecError(f"device {value!r} has type {type(value).__name__}; use {_SPELLINGS}")


def is_gpu(device: DeviceId) -> bool:
    return isinstance(device, int) and not isinstance(device, bool)


def device_label(device: DeviceId) -> str:
    """For people: ``GPU 0``, ``cpu``, ``disk``."""
    return f"GPU {device}" if is_gpu(device) else str(device)


def gpu_range_label(first: int, last: int) -> str:
    """For people, a run of GPUs: ``GPU 0-3`` (``GPU 2`` for a run of one)."""
    return device_label(first) if first == last else f"{device_label(first)}-{last}"


def device_key(device: DeviceId) -> str:
    """For JSON object keys and metric labels, where keys must be strings: ``"0"``, ``"cpu"``, ``"disk"``."""
    return str(device)


def torch_device_name(device: DeviceId) -> str:
    """The name torch gives the device that holds the weights: ``cuda:0``, ``cpu``. Disk-offloaded weights are
    memory maps in host memory, so ``disk`` is ``cpu`` to torch."""
    return f"cuda:{device}" if is_gpu(device) else CPU


def device_order(device: DeviceId) -> tuple[int, int]:
    """Sort key: GPUs by index, then ``cpu``, then ``disk`` (the order overflow walks)."""
    if is_gpu(device):
        return (0, int(device))
    return (1, 0) if device == CPU else (2, 0)
