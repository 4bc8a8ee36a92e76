"""How many threads torch's intra-op pool and the native kernels run on, chosen again while the server runs.

torch's CPU ops and the kernels of :mod:`loaders.native` share one OpenMP runtime (the kernels bind to the
``libgomp`` torch loaded and pass ``torch.get_num_threads()`` on every call), so one number sets both pools and
they never fight: the ceiling comes from :func:`planner.hardware.cpu_share.cpu_share` (affinity mask, cgroup quota,
``--threads``).

Below that ceiling the count follows the CPU this process actually gets. Every parallel region ends in a barrier,
so a team of N threads moves at the pace of its slowest member: when a neighbour's busy loop takes one of our
cores, the thread that shares it runs in the scheduler's time slices and every region of every layer waits for it.
Measured on the 100M fp32 Llama on 2 cores with one busy neighbour, a 64-token request took 16x longer on two
threads than on one. The :class:`ThreadGovernor` watches the kernel's own account of it: the time this process's
threads spent runnable but waiting for a CPU (``/proc/self/task/*/schedstat``, the run-queue delay) against the
time they ran. Past :data:`WAIT_LIMIT` it drops a thread; after a quiet hold it tries one more again and keeps it
only if the wait stays low, holding twice as long after each failed try (up to :data:`MAX_HOLD_S`).

It runs on the engine thread and sets the count there: torch reads its thread count per thread (OpenMP's
``nthreads-var`` is a per-thread setting), so a call from another thread would not reach the engine's pool.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Run-queue wait per second of run time above which the team is too big for the CPU it gets. Two threads beside
#: one busy loop on two cores wait about 0.5 s per second run; a quiet server's stay under 0.1.
WAIT_LIMIT = 0.25
#: Seconds of engine time one measurement spans.
WINDOW_S = 0.5
#: Seconds at a lower count before one more thread is tried, and the most that doubles to after failed tries.
HOLD_S = 5.0
MAX_HOLD_S = 60.0
#: Run time a window must hold to be judged (an idle engine's windows say nothing about contention).
MIN_BUSY_S = 0.1


def read_schedstat(task_dir: str = "/proc/self/task") -> tuple[float, float] | None:
    """Seconds this process's threads have run and have waited runnable for a CPU, summed over its threads; None
    where the kernel does not keep schedstats."""
    ran = waited = 0
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "schedstat")) as f:
                fields = f.read().split()
        except OSError:  # the thread ended between the listing and the read
            continue
        if len(fields) >= 2:
            ran += int(fields[0])
            waited += int(fields[1])
    return ran / 1e9, waited / 1e9


@dataclass
class _Window:
    started: float
    ran: float
    waited: float


class ThreadGovernor:
    """The engine thread's thread count: ``ceiling`` to start with, fewer while the CPU is contended.

    ``adaptive=False`` (``--threads`` given) keeps the ceiling. ``set_threads``, ``clock`` and ``sample`` are
    injectable so tests can drive it with fake contention."""

    def __init__(
        self,
        ceiling: int,
        *,
        adaptive: bool = True,
        reason: str = "",
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], tuple[float, float] | None] = read_schedstat,
    ):
        self.ceiling = max(1, ceiling)
        self.current = self.ceiling
        self.adaptive = adaptive and self.ceiling > 1
        self.reason = reason
        self._set = set_threads or _torch_set_threads
        self._clock = clock
        self._sample = sample
        self._window: _Window | None = None
        self._hold_s = HOLD_S
        self._hold_until = 0.0
        self._probing = False
        self.last_wait_ratio: float | None = None
        self.changes = 0

    def start(self) -> None:
        """Set the count on the calling thread (the engine's) and open the first window."""
        self._set(self.current)
        self._window = self._open()

    def after_step(self) -> None:
        """Called after each engine step: closes a window every :data:`WINDOW_S` and adapts the count."""
        if not self.adaptive or self._window is None:
            return
        now = self._clock()
        if now - self._window.started < WINDOW_S:
            return
        sample = self._sample()
        if sample is None:
            self.adaptive = False  # no schedstats on this kernel: keep the ceiling
            return
        ran, waited = sample[0] - self._window.ran, sample[1] - self._window.waited
        self._window = _Window(now, *sample)
        if ran < MIN_BUSY_S:
            return
        self.last_wait_ratio = waited / ran
        self._decide(now, self.last_wait_ratio)

    def _decide(self, now: float, ratio: float) -> None:
        if self._probing:  # the window just measured ran one thread more than before
            self._probing = False
            if ratio > WAIT_LIMIT:
                self._hold_s = min(self._hold_s * 2, MAX_HOLD_S)
                self._change(self.current - 1, now)
            else:
                self._hold_s = HOLD_S
            return
        if ratio > WAIT_LIMIT and self.current > 1:
            self._change(self.current - 1, now)
        elif ratio < WAIT_LIMIT / 2 and self.current < self.ceiling and now >= self._hold_until:
            self._probing = True
            self._change(self.current + 1, now)

    def _change(self, threads: int, now: float) -> None:
        self.current = threads
        self.changes += 1
        self._hold_until = now + self._hold_s
        self._set(threads)
        self._window = self._open()

    def _open(self) -> _Window:
        sample = self._sample() or (0.0, 0.0)
        return _Window(self._clock(), *sample)

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.current,
            "ceiling": self.ceiling,
            "adaptive": self.adaptive,
            "wait_ratio": None if self.last_wait_ratio is None else round(self.last_wait_ratio, 3),
            "changes": self.changes,
            "reason": self.reason,
        }


def _torch_set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
