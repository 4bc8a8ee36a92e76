"""Rates measured on this machine by ``loadmaster env --calibrate``: the record, where it lives, reading and saving.

The cost model's defaults are round figures for a generic machine; a CPU with native kernels decodes at the rate
its kernels reach, not at a textbook DRAM figure. Calibration measures those rates once and saves them to the
user's cache; :mod:`planner.placement.cost_model` uses them when present (and says so in the plan's cost-model line).

A saved file is only trusted for the machine that wrote it (same CPU model and core count) and only when it
validates; anything else is ignored with a warning, never an error: a stale cache must not break planning.
Plain JSON and the standard library: the planner core imports no torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planner.user_cache import user_cache_path, write_text_atomically

log = logging.getLogger(__name__)

#: 2: per-call kernel cost, rates fitted over a shape sweep, and the extra cost of a disk layer.
#: 3: a cost per output row, fitted over two row widths; the per-layer figure no longer holds the small probe
#: layers' own bytes and rows (a version-2 file counted them twice).
FORMAT_VERSION = 3
#: ``LOADMASTER_CALIBRATION``: a file path, or ``off`` to plan with the default figures.
ENV_VAR = "LOADMASTER_CALIBRATION"


@dataclass(frozen=True)
class KernelRate:
    """Bytes of weights per second one decode-time linear path reaches, for one dtype.

    A one-row product takes ``call_overhead + output rows * row_overhead + weight bytes / rate`` seconds: the three
    are fitted over a sweep of matrix sizes and row widths, each read from a pool larger than the CPU's caches, as a
    decode step reads its weights once each. ``resident``: weights in RAM; ``mapped``: weights read in place from a
    memory-mapped file whose pages are cached (a warm ``disk`` block). ``path`` is ``native`` (loaders/cpu_kernels)
    or ``torch``.

    Why a cost per row: each output is one dot product, finished by a horizontal sum and a store whatever its
    length, so narrow matrices read fewer bytes per unit of that cost. Measured here (AMD EPYC, fp32): about 60 ns per
    row, which makes a 768-wide matrix (the 100M Llama) read at ~14 GB/s where a 2048-wide one reaches ~19.
    """

    dtype: str
    path: str
    resident: float
    mapped: float
    #: Seconds one call costs whatever its size (dispatch, thread fork/join, the first cache lines' latency).
    call_overhead: float = 0.0
    #: Seconds each output row (one dot product) costs besides its bytes.
    row_overhead: float = 0.0
    #: The fraction of a one-row product's time each further row of x (another sequence of the decode batch) adds,
    #: from 16 rows against one on the sweep's largest matrices; None where not measured (older calibrations).
    extra_row_cost: float | None = None


@dataclass(frozen=True)
class Calibration:
    """What ``loadmaster env --calibrate`` measured. Rates are bytes/s, times seconds."""

    machine: str
    created: str
    threads: int
    memory_read: float
    disk_cold: float
    disk_warm: float
    kernels: dict[str, KernelRate]
    #: Seconds a decode step spends per decoder layer besides reading weights (attention, norms, dispatch).
    layer_overhead: float
    #: Seconds a decode step spends once, whatever the model (generation loop, sampling, embedding, dispatch).
    step_overhead: float
    #: Host -> GPU copy rate; None without a GPU.
    link: float | None = None
    #: Seconds a decoder layer placed on ``disk`` (memory-mapped, warm, with its readahead hook) adds per decode step
    #: over the same layer resident, besides reading its weights at the mapped rate.
    disk_layer_overhead: float = 0.0
    version: int = FORMAT_VERSION
    notes: list[str] = field(default_factory=list)

    def kernel_rate(self, dtype: str | None, mapped: bool = False) -> float:
        """The measured decode rate for ``dtype``'s weights (the memory read rate for dtypes not measured).

        The mapped rate is capped at the resident one: a warm ``disk`` block reads the same RAM through a map (and
        the loader's resident weights are themselves populated maps of the checkpoint when no cast is needed), so
        a higher mapped figure is the noise of one sample, and it must not make a plan with disk look faster."""
        k = self.kernels.get(dtype or "")
        if k is None:
            return self.memory_read
        return min(k.mapped, k.resident) if mapped else k.resident

    def call_overhead(self, dtype: str | None) -> float:
        """Seconds one decode-time linear call of ``dtype`` costs besides its bytes (0 for dtypes not measured)."""
        k = self.kernels.get(dtype or "")
        return 0.0 if k is None else k.call_overhead

    def row_overhead(self, dtype: str | None) -> float:
        """Seconds each output row of a decode-time linear call of ``dtype`` costs besides its bytes (0 if not
        measured)."""
        k = self.kernels.get(dtype or "")
        return 0.0 if k is None else k.row_overhead

    def extra_row_cost(self, family: str | None) -> float | None:
        """The measured :attr:`KernelRate.extra_row_cost` of ``family``'s kernels (a dtype), or None."""
        k = self.kernels.get(family or "")
        return None if k is None else k.extra_row_cost

    def summary(self) -> str:
        kernels = ", ".join(
            f"{k.dtype} {k.path} {k.resident / 1e9:.1f}/{k.mapped / 1e9:.1f} GB/s + {k.call_overhead * 1e6:.0f} us/call"
            f" + {k.row_overhead * 1e9:.0f} ns/row"
            + (f" + {k.extra_row_cost:.1%} per decode row" if k.extra_row_cost is not None else "")
            for k in self.kernels.values()
        )
        link = f", link {self.link / 1e9:.1f} GB/s" if self.link else ""
        return (
            f"calibrated {self.created} on {self.machine}: memory {self.memory_read / 1e9:.1f} GB/s, "
            f"disk {self.disk_cold / 1e9:.2f} GB/s cold / {self.disk_warm / 1e9:.1f} warm{link}, "
            f"kernels (resident/mapped) {kernels}, overhead {self.layer_overhead * 1e3:.2f} ms per layer "
            f"(+{self.disk_layer_overhead * 1e3:.2f} on disk) + {self.step_overhead * 1e3:.2f} ms per step"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        """Validate and build; raises ``ValueError`` saying which field is wrong."""
        if not isinstance(d, Mapping):
            raise ValueError("a calibration is a JSON object")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {d.get('version')!r}, expected {FORMAT_VERSION}")

        def rate(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e14:
                raise ValueError(f"{name} must be a positive number of bytes/s, got {value!r}")
            return float(value)

        def seconds(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be seconds in [0, 1), got {value!r}")
            return float(value)

        def fraction(name: str, value: Any) -> float | None:
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10:
                raise ValueError(f"{name} must be a fraction in [0, 10), got {value!r}")
            return float(value)

        kernels_in = d.get("kernels")
        if not isinstance(kernels_in, Mapping) or not kernels_in:
            raise ValueError("kernels must be a non-empty object of dtype -> rates")
        kernels = {}
        for dtype, k in kernels_in.items():
            if not isinstance(k, Mapping) or k.get("path") not in ("native", "torch"):
                raise ValueError(f"kernels[{dtype!r}] must name its path ('native' or 'torch') and its rates")
            kernels[str(dtype)] = KernelRate(
                dtype=str(dtype),
                path=k["path"],
                resident=rate(f"kernels.{dtype}.resident", k.get("resident")),
                mapped=rate(f"kernels.{dtype}.mapped", k.get("mapped")),
                call_overhead=seconds(f"kernels.{dtype}.call_overhead", k.get("call_overhead", 0.0)),
                row_overhead=seconds(f"kernels.{dtype}.row_overhead", k.get("row_overhead", 0.0)),
                extra_row_cost=fraction(f"kernels.{dtype}.extra_row_cost", k.get("extra_row_cost")),
            )

        threads = d.get("threads")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        for key in ("machine", "created"):
            if not isinstance(d.get(key), str):
                raise ValueError(f"{key} must be a string")
        link = d.get("link")
        return cls(
            machine=d["machine"],
            created=d["created"],
            threads=threads,
            memory_read=rate("memory_read", d.get("memory_read")),
            disk_cold=rate("disk_cold", d.get("disk_cold")),
            disk_warm=rate("disk_warm", d.get("disk_warm")),
            kernels=kernels,
            layer_overhead=seconds("layer_overhead", d.get("layer_overhead")),
            step_overhead=seconds("step_overhead", d.get("step_overhead")),
            disk_layer_overhead=seconds("disk_layer_overhead", d.get("disk_layer_overhead", 0.0)),
            link=None if link is None else rate("link", link),
            notes=[str(n) for n in d.get("notes", [])],
        )


@dataclass(frozen=True)
class CallPoint:
    """One size of the kernel sweep: the weight bytes and output rows of a one-row product, and its seconds."""

    nbytes: int
    rows: int
    seconds: float


@dataclass(frozen=True)
class CallFit:
    """``seconds = overhead + rows * row_overhead + bytes / rate`` for one decode-time linear call."""

    rate: float
    overhead: float
    row_overhead: float = 0.0


def _weighted_least_squares(columns: list[list[float]], y: list[float], w: list[float]) -> list[float] | None:
    """Coefficients of ``y ~ sum(c_j * columns[j])`` minimising the weighted squared error; None when singular."""
    n = len(columns)
    a = [[sum(wi * ci * cj for wi, ci, cj in zip(w, columns[r], columns[c])) for c in range(n)] for r in range(n)]
    b = [sum(wi * ci * yi for wi, ci, yi in zip(w, columns[r], y)) for r in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting on an n x n system (n <= 3)
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * yv for x, yv in zip(a[r], a[col])]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


def fit_calls(points: list[CallPoint]) -> CallFit:
    """Least squares of seconds per call against a fixed cost, output rows and weight bytes, weighted so each point
    counts by its relative error (the smallest calls would otherwise not count at all). Bytes and rows must vary
    independently (the sweep uses two row widths) for the row cost to be told apart from the rate. Where noise
    pushes a coefficient below zero the fit drops terms (the row cost, then the fixed cost) rather than report it;
    with neither it is the largest size's rate."""
    t = [p.seconds for p in points]
    w = [1.0 / (s * s) for s in t]
    ones = [1.0] * len(points)
    nbytes = [float(p.nbytes) for p in points]
    rows = [float(p.rows) for p in points]
    for cols, names in (
        ([ones, rows, nbytes], ("overhead", "row_overhead", "per_byte")),
        ([ones, nbytes], ("overhead", "per_byte")),
    ):
        coef = _weighted_least_squares(cols, t, w)
        if coef is not None and all(c >= 0 for c in coef) and coef[-1] > 0:
            got = dict(zip(names, coef))
            return CallFit(
                rate=1.0 / got["per_byte"], overhead=got["overhead"], row_overhead=got.get("row_overhead", 0.0)
            )
    big = max(points, key=lambda p: p.nbytes)
    return CallFit(rate=big.nbytes / big.seconds, overhead=0.0)


def cpu_model_name() -> str | None:
    """The CPU's model name as Linux reports it (``/proc/cpuinfo``); None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_id() -> str:
    """What a calibration is valid for: the CPU model and the cores this process may use."""
    model = cpu_model_name() or "unknown CPU"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return f"{model} x{cores}"


def calibration_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """``$LOADMASTER_CALIBRATION``, else ``$XDG_CACHE_HOME/loadmaster/calibration.json``; None when ``off``."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip()
    if value.lower() in ("off", "none", "0", "false"):
        return None
    if value:
        return Path(value).expanduser()
    return user_cache_path("calibration.json", environ=env)


_cache: dict[Path, tuple[float, Calibration | None]] = {}


def load_calibration(path: Path | None = None, *, check_machine: bool = True) -> Calibration | None:
    """The saved calibration, or None (no file, ``off``, invalid, or made on another machine: logged)."""
    if path is None:
        path = calibration_path()
    if path is None:
        return None
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    hit = _cache.get(path)
    if hit is not None and hit[0] == mtime:
        return hit[1]
    cal: Calibration | None
    try:
        cal = Calibration.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        log.warning("ignoring calibration %s: %s; run 'loadmaster env --calibrate' again", path, exc)
        cal = None
    if cal is not None and check_machine and cal.machine != machine_id():
        log.warning(
            "ignoring calibration %s: made on %s, this is %s; run 'loadmaster env --calibrate' here",
            path,
            cal.machine,
            machine_id(),
        )
        cal = None
    _cache[path] = (mtime, cal)
    return cal


def save_calibration(cal: Calibration, path: Path) -> Path:
    """Write atomically (temporary file in the same folder, then rename): readers never see half a file."""
    Calibration.from_dict(cal.to_dict())  # what is saved must load back
    write_text_atomically(path, json.dumps(cal.to_dict(), indent=2))
    _cache.pop(path, None)
    return path
