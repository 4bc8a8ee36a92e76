"""Byte sizes as users write them, and as we print them.

GiB/MiB/KiB/TiB are powers of 2; GB/MB/KB/TB are powers of 10. Every output labels its unit the same way
(``format_bytes`` prints binary units, ``GiB`` etc.), so a number printed by loadmaster can be pasted back in.
"""

from __future__ import annotations

import re

from planner.errors import HardwareSpecError, PlanError

#: The link between hosts when nobody says: 10 GbE, in bytes per second.
DEFAULT_INTER_HOST_BANDWIDTH = 1.25e9

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Read ``20GiB``, ``20GB``, ``512MiB``, ``1.5TiB``, ``80GB`` or a plain number of bytes; return bytes."""
    if isinstance(value, bool):
        raise HardwareSpecError(f"memory size {value!r} is a boolean; give bytes or a string such as '20GiB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise HardwareSpecError(f"memory size {value} is negative; sizes must be >= 0 bytes")
        if value != value or value == float("inf"):
            raise HardwareSpecError(f"memory size {value} is not a finite number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise HardwareSpecError(f"memory size {value!r} has type {type(value).__name__}; give bytes or '20GiB'")
    text = value.strip()
    if text.startswith("-"):
        raise HardwareSpecError(f"memory size {value!r} is negative; sizes must be >= 0 bytes")
    m = _SIZE_RE.match(text)
    if not m:
        raise HardwareSpecError(
            f"cannot read memory size {value!r}; write a number with a unit, e.g. '24GiB', '80GB', '512MiB', or bytes"
        )
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit in ("", "b"):
        factor = 1
    elif unit in _UNITS:
        factor = _UNITS[unit]
    elif unit in ("k", "m", "g", "t"):
        factor = _UNITS[unit + "ib"]  # a bare letter means the binary unit, as in 'free -g'
    else:
        raise HardwareSpecError(
            f"unknown unit {m.group(2)!r} in memory size {value!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    total = number * factor
    if total != total or total == float("inf"):
        raise HardwareSpecError(f"memory size {value!r} is too large to be a number of bytes; give a real size")
    return int(round(total))


def format_bytes(n: int | float) -> str:
    """Binary units with one decimal: ``format_bytes(2**30) == '1.0GiB'``. Negative sizes keep their sign."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{sign}{n / factor:.1f}{unit}"
    return f"{sign}{int(n)}B"


def parse_rate(text: str | None) -> float:
    """``12.5GB`` or ``12.5GB/s`` -> bytes/s; ``100Gb`` (lower-case b: bits) -> 12.5e9."""
    if text is None:
        return DEFAULT_INTER_HOST_BANDWIDTH
    t = text.strip().removesuffix("/s").removesuffix("ps")
    bits = t.endswith("b") and not t.endswith("B")
    try:
        value = float(parse_size(t[:-1] + "B" if bits else t))
    except PlanError as e:
        raise PlanError(f"--inter-host-bandwidth {text!r}: {e}; write e.g. 100Gb (bits) or 12.5GB (bytes)") from None
    return value / 8 if bits else value
