"""How many threads torch's intra-op pool and the native kernels run on, chosen again while the server runs.

torch's CPU ops and the kernels of :mod:`loaders.native` share one OpenMP runtime (the kernels bind to the
``libgomp`` torch loaded and pass ``torch.get_num_threads()`` on every call), so one number sets both pools and
they never fight: the ceiling comes from :func:`planner.hardware.cpu_share.cpu_share` (affinity mask, cgroup quota,
``--threads``).

Below that ceiling the count follows the speed this process actually gets. Every parallel region ends in a
barrier, so a team of N threads moves at the pace of its slowest member: when a neighbour's busy loop takes one of
our cores, the thread that shares it runs in the scheduler's time slices and every region of every layer waits for
it. Measured on the 100M fp32 Llama on 2 cores with one busy neighbour, a 64-token request took 16x longer on two
threads than on one. But a neighbour that only takes part of a core (a benchmark client reading 16 streams) leaves
two threads faster than one, though they wait for a CPU just as often. So waiting is only the trigger, and speed
decides:

- The :class:`ThreadGovernor` watches the kernel's account of contention: the time this process's threads spent
  runnable but waiting for a CPU (``/proc/self/task/*/schedstat``, the run-queue delay) against the time they ran.
- Past :data:`WAIT_LIMIT` it tries one thread fewer for a few decode steps, and keeps it only when those steps run
  faster than the same-width steps just before (:class:`StepClock`); otherwise it goes back and waits twice as long
  before it tries again (up to :data:`MAX_HOLD_S`).
- At a lower count it tries one more after a hold, kept on the same test.
- A decode step wider than any the last try saw ends the hold and restores the ceiling: one thread may be as fast
  as two for a lone stream, and not for a wave of sixteen.
- A step with prompt tokens (or drafts) ends a running try at once, unjudged, and no try starts right after one: a
  wave's prefill run on the tried count cost seconds at half speed (a try started on a lone stream's last steps ran
  the next wave's 16-prompt prefill on one thread), and such a step says nothing about decode speed.

It runs on the engine thread and sets the count there: torch reads its thread count per thread (OpenMP's
``nthreads-var`` is a per-thread setting), so a call from another thread would not reach the engine's pool.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

#: Run-queue wait per second of run time above which fewer threads may be faster. Two threads beside one busy loop
#: on two cores wait about 0.5 s per second run; a quiet server's stay under 0.1.
WAIT_LIMIT = 0.25
#: Seconds of engine time one contention measurement spans.
WINDOW_S = 0.5
#: Seconds after a change (or a failed try) before the next try, and the most that doubles to after failed tries.
HOLD_S = 5.0
MAX_HOLD_S = 60.0
#: Run time a window must hold to be judged (an idle engine's windows say nothing about contention).
MIN_BUSY_S = 0.1
#: Comparable decode steps a try runs before it is judged, and the longest it may wait for them.
TRIAL_STEPS = 6
TRIAL_MAX_S = 3.0
#: Baseline steps of the current width a try needs before it starts.
MIN_BASELINE_STEPS = 3
#: A try is kept only when its steps take at most this share of the time of the same-width steps before it.
KEEP_BELOW = 0.95
#: Comparable steps remembered at the current count, the baseline a try is measured against.
BASELINE_STEPS = 64


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


def width_bucket(rows: int) -> int:
    """Decode steps of similar width cost alike: 1, 2, 3-4, 5-8, ... rows share a bucket."""
    return max(rows - 1, 0).bit_length()


@dataclass
class StepClock:
    """Seconds of pure decode steps by width bucket: the steps at the current count (the baseline) and those of a
    running try. A try is judged on the median ratio of its steps to the baseline's median at the same width, so a
    batch that grows or shrinks during the try does not decide it."""

    baseline: deque = field(default_factory=lambda: deque(maxlen=BASELINE_STEPS))  # (bucket, seconds)
    trial: list[tuple[int, float]] = field(default_factory=list)

    def add(self, rows: int, seconds: float, trying: bool) -> None:
        (self.trial if trying else self.baseline).append((width_bucket(rows), seconds))

    def matched(self) -> list[float]:
        """Each try step's seconds over the baseline's median at its width; steps of a width the baseline lacks are
        left out."""
        by_bucket: dict[int, list[float]] = {}
        for bucket, seconds in self.baseline:
            by_bucket.setdefault(bucket, []).append(seconds)
        medians = {b: statistics.median(s) for b, s in by_bucket.items()}
        return [s / medians[b] for b, s in self.trial if medians.get(b)]

    def baseline_steps(self, bucket: int) -> int:
        """Baseline steps of width bucket ``bucket``: a try needs some to be judged against."""
        return sum(1 for b, _ in self.baseline if b == bucket)

    def restart(self) -> None:
        """The count changed for good: the try's steps become the baseline."""
        self.baseline.clear()
        self.baseline.extend(self.trial)
        self.trial.clear()


@dataclass
class _Window:
    started: float
    ran: float
    waited: float


@dataclass
class ThreadTry:
    """A finished try: the count it left and the one it tried, the comparable steps it was judged on, the median
    of their time over the same-width steps before it (None: no comparable step), and whether it was kept."""

    from_threads: int
    to_threads: int
    steps: int
    time_ratio: float | None
    kept: bool


@dataclass
class _Trial:
    threads: int  # the count being tried
    previous: int  # the count to go back to
    started: float


class ThreadGovernor:
    """The engine thread's thread count: ``ceiling`` to start with, fewer while fewer measure faster.

    ``adaptive=False`` (``--threads`` given) keeps the ceiling. ``set_threads``, ``clock`` and ``sample`` are
    injectable so tests can drive it with fake contention and fake step times."""

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
        self._steps = StepClock()
        self._trial: _Trial | None = None
        self._hold_s = HOLD_S
        self._hold_until = 0.0
        self.last_wait_ratio: float | None = None
        self.last_trial: ThreadTry | None = None
        self._judged_widths: set[int] = set()  # the width buckets the last judged try's steps had
        self._last_pure = False  # whether the last step was a pure decode step (a try may start after it)
        self.changes = 0

    def start(self) -> None:
        """Set the count on the calling thread (the engine's) and open the first window."""
        self._set(self.current)
        self._window = self._open()

    def decode_step(self, rows: int, seconds: float) -> None:
        """A pure decode step (no prompt tokens, no drafts) of ``rows`` rows took ``seconds``: the steps a try is
        timed on. A step wider than any the last judged try saw ends the hold, and a count below the ceiling goes back
        to it at once: that try spoke of narrower steps (one thread may be as fast as two for a lone stream, and not
        for sixteen); contention, if it remains, starts a new try on these steps. Narrower steps do not: a wave's
        tail would otherwise start a try at every width it passes."""
        if not self.adaptive or rows <= 0:
            return
        self._last_pure = True
        self._steps.add(rows, seconds, trying=self._trial is not None)
        if self._trial is None and self._judged_widths and width_bucket(rows) > max(self._judged_widths):
            self._judged_widths = set()
            self._hold_until = 0.0
            self._hold_s = HOLD_S
            if self.current < self.ceiling:  # the drop was judged on narrower steps: back to the ceiling at once
                self._steps.baseline.clear()
                self._apply(self.ceiling)
                self._window = self._open()

    def mixed_step(self) -> None:
        """A step fed prompt tokens or drafts: it times no try, so a running one ends now, unjudged, back at the
        count before it (held :data:`HOLD_S`, not doubled: the try was not found slower)."""
        if not self.adaptive:
            return
        self._last_pure = False
        trial = self._trial
        if trial is None:
            return
        self.last_trial = ThreadTry(trial.previous, trial.threads, len(self._steps.matched()), None, False)
        self._trial = None
        self._steps.trial.clear()
        self._apply(trial.previous)
        self._hold_until = self._clock() + self._hold_s
        self._window = self._open()

    def after_step(self) -> None:
        """Called after each engine step: judges a running try, or closes a contention window every
        :data:`WINDOW_S` and starts one."""
        if not self.adaptive or self._window is None:
            return
        now = self._clock()
        if self._trial is not None:
            self._judge_trial(now)
            return
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
        self._maybe_try(now, self.last_wait_ratio)

    def _maybe_try(self, now: float, ratio: float) -> None:
        if now < self._hold_until or not self._last_pure:
            return
        last = self._steps.baseline[-1][0] if self._steps.baseline else None
        if last is None or self._steps.baseline_steps(last) < MIN_BASELINE_STEPS:
            return  # nothing yet to judge a try of these steps against (a wave just began): wait a window
        if ratio > WAIT_LIMIT and self.current > 1:
            self._begin_trial(self.current - 1, now)
        elif self.current < self.ceiling:
            self._begin_trial(self.current + 1, now)

    def _begin_trial(self, threads: int, now: float) -> None:
        self._trial = _Trial(threads, self.current, now)
        self._steps.trial.clear()
        self._apply(threads)

    def _judge_trial(self, now: float) -> None:
        trial = self._trial
        assert trial is not None
        ratios = self._steps.matched()
        unmatched = len(self._steps.trial) - len(ratios)
        if len(ratios) < TRIAL_STEPS and unmatched < TRIAL_STEPS and now - trial.started < TRIAL_MAX_S:
            return
        self._judged_widths = {bucket for bucket, _ in self._steps.trial}
        ratio = statistics.median(ratios) if ratios else None
        kept = ratio is not None and ratio <= KEEP_BELOW
        self.last_trial = ThreadTry(
            trial.previous, trial.threads, len(ratios), None if ratio is None else round(ratio, 3), kept
        )
        self._trial = None
        if kept:
            self.changes += 1
            self._hold_s = HOLD_S
            self._steps.restart()
        else:
            self._hold_s = min(self._hold_s * 2, MAX_HOLD_S)
            self._steps.trial.clear()
            self._apply(trial.previous)
        self._hold_until = now + self._hold_s
        self._window = self._open()

    def _apply(self, threads: int) -> None:
        self.current = threads
        self._set(threads)

    def _open(self) -> _Window:
        sample = self._sample() or (0.0, 0.0)
        return _Window(self._clock(), *sample)

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.current,
            "ceiling": self.ceiling,
            "adaptive": self.adaptive,
            "wait_ratio": None if self.last_wait_ratio is None else round(self.last_wait_ratio, 3),
            "trying": self._trial is not None,
            "last_trial": None if self.last_trial is None else asdict(self.last_trial),
            "changes": self.changes,
            "reason": self.reason,
        }


def _torch_set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
