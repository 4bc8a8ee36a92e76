"""What a load reports while it runs (LoadProgress) and after it finishes (LoadStats), and how a long step shows its
progress (:func:`progress_bar`: a bar on a terminal, a few log lines in a redirected log)."""

from __future__ import annotations

import logging
import resource
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from planner.hardware.devices import parse_device
from planner.hardware.units import format_bytes
from planner.types import DeviceId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadProgress:
    """One step of a load, handed to the ``progress`` callback (the service's /health/ready reports it)."""

    bytes_done: int
    bytes_total: int
    phase: str  # "building", "loading", "offloading", "dispatching", "ready" (or "failed")
    #: Bytes placed so far per device ("cpu", "disk", "cuda:N"), and the overall rate since the load began.
    bytes_per_device: dict[str, int] = field(default_factory=dict)
    bytes_per_second: float = 0.0

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0


@dataclass
class LoadStats:
    """What a load cost. ``bytes_per_device`` keys are ``"cpu"``, ``"disk"`` or ``"cuda:N"``."""

    seconds: float = 0.0
    bytes_per_device: dict[str, int] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    offload_bytes_written: int = 0
    #: Bytes served straight from the checkpoint's shards through memory maps (disk blocks, no copy).
    zero_copy_bytes: int = 0
    #: Bytes read from the shards into memory (RAM or GPU).
    bytes_read: int = 0
    #: Linear layers switched to the native CPU kernels (:mod:`loaders.native.linear`).
    native_linears: int = 0
    #: Whether decode steps' attention runs on the native CPU kernel (:mod:`loaders.native.attention`).
    native_attention: bool = False
    #: What ``cpu_quantization`` did (a :class:`loaders.native.quantization.QuantizationStats`), or None.
    cpu_quantization: object | None = None
    #: What ``cpu_residency`` did (a :class:`loaders.checkpoint.residency.ResidencyStats`), or None.
    residency: object | None = None

    def bytes_by_device_id(self) -> dict[DeviceId, int]:
        """``bytes_per_device`` keyed as device maps and plans key devices: GPU index, "cpu" or "disk"."""
        out: dict[DeviceId, int] = {}
        for label, n in self.bytes_per_device.items():
            device = parse_device(label)
            out[device] = out.get(device, 0) + n
        return out


#: How often a progress line goes to the log when stderr is not a terminal (a bar would write a redraw per step).
LOG_EVERY_S = 10.0


class LogProgress:
    """A progress bar's stand-in where stderr is a file or a pipe: a log line every ``every_s`` seconds and one at
    the end, instead of the hundreds of carriage-return redraws a bar would write into the log. It takes the calls
    the bar takes (``update``, ``set_description``, ``set_postfix``, ``close``)."""

    def __init__(
        self, total: int, desc: str, unit: str, logger: logging.Logger, every_s: float = LOG_EVERY_S, nbytes=False
    ):
        self.total, self.desc, self.unit, self.logger, self.every_s = total, desc, unit, logger, every_s
        self.nbytes = nbytes
        self.n = 0
        self.postfix = ""
        self._t0 = self._last = time.monotonic()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every_s and self.n < self.total:
            self._last = now
            self._line()

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.n and time.monotonic() - self._t0 >= self.every_s:  # a quick step needs no closing line
                self._line(done=True)

    def _count(self, n: float) -> str:
        return format_bytes(n) if self.nbytes else f"{int(n)} {self.unit}"

    def _line(self, done: bool = False) -> None:
        elapsed = time.monotonic() - self._t0
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        per_s = self.n / elapsed if elapsed > 0 else 0.0
        rate = format_bytes(per_s) + "/s" if self.nbytes else f"{per_s:.1f} {self.unit}/s"
        extra = f", {self.postfix}" if self.postfix else ""
        what = "done" if done else "so far"
        self.logger.info(
            "%s: %s of %s%s %s, %.0f s, %s%s",
            self.desc,
            self._count(self.n),
            self._count(self.total),
            share,
            what,
            elapsed,
            rate,
            extra,
        )


def progress_bar(
    total: int, desc: str, unit: str, logger: logging.Logger, show: bool = True, nbytes: bool = False
) -> Any:
    """A tqdm bar where stderr is a terminal; a :class:`LogProgress` (a line every ``LOG_EVERY_S``) where it is
    not; a silent bar when ``show`` is False."""
    if show and not _stderr_is_terminal():
        return LogProgress(total, desc, unit, logger, nbytes=nbytes)
    scale = dict(unit_scale=True, unit_divisor=1024) if nbytes else {}
    return tqdm(total=total, unit=unit, desc=desc, disable=not show, leave=False, **scale)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by something without isatty, or closed
        return False


class ProgressReporter:
    """Thread-safe byte counter feeding both a tqdm bar and the caller's callback.

    Reader threads call :meth:`advance`; the callback is called under a lock so a consumer never sees
    ``bytes_done`` go backwards.
    """

    def __init__(self, total: int, callback: Callable[[LoadProgress], None] | None, show_bar: bool = True):
        self.total = int(total)
        self.done = 0
        self.phase = "validating"
        self._callback = callback
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.by_device: dict[str, int] = {}
        self._bar = progress_bar(self.total, "loading", "B", log, show=show_bar, nbytes=True)

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self._bar.set_description(phase)
            self._emit()

    def advance(self, nbytes: int, device: str = "cpu") -> None:
        with self._lock:
            self.done = min(self.total, self.done + int(nbytes))
            self.by_device[device] = self.by_device.get(device, 0) + int(nbytes)
            self._bar.update(int(nbytes))
            self._emit()

    def close(self) -> None:
        with self._lock:
            self.done = self.total
            self.phase = "ready"
            self._emit()
            self._bar.close()

    def fail(self) -> None:
        """The load stopped: report phase "failed" and take the bar down."""
        with self._lock:
            self.phase = "failed"
            self._emit()
            self._bar.close()

    def _emit(self) -> None:
        if self._callback is not None:
            try:
                elapsed = time.perf_counter() - self._t0
                self._callback(
                    LoadProgress(
                        self.done,
                        self.total,
                        self.phase,
                        dict(self.by_device),
                        self.done / elapsed if elapsed > 0 else 0.0,
                    )
                )
            except Exception:  # a broken observer must not break a load
                log.exception("progress callback failed")


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0), so a load measures only itself."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: VmHWM (resettable) where Linux has it, else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
