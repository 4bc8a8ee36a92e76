"""The thread governor from fake contention: it drops a thread while the process's threads wait for a CPU, tries
one more after a hold, keeps it only where the wait stays low, and backs off after each failed try."""

from __future__ import annotations

import os
import threading

import pytest

from loaders.native import cpu_threads
from loaders.native.cpu_threads import HOLD_S, MAX_HOLD_S, WAIT_LIMIT, WINDOW_S, ThreadGovernor, read_schedstat


class FakeCpu:
    """A clock and a schedstat whose run-queue wait per second run the test sets."""

    def __init__(self) -> None:
        self.now = 0.0
        self.ran = 0.0
        self.waited = 0.0
        self.wait_ratio = 0.0
        self.set_to: list[int] = []

    def advance(self, seconds: float = WINDOW_S) -> None:
        self.now += seconds
        self.ran += seconds
        self.waited += seconds * self.wait_ratio

    def governor(self, ceiling: int = 2, adaptive: bool = True) -> ThreadGovernor:
        g = ThreadGovernor(
            ceiling,
            adaptive=adaptive,
            set_threads=self.set_to.append,
            clock=lambda: self.now,
            sample=lambda: (self.ran, self.waited),
        )
        g.start()
        return g


def _steps(cpu: FakeCpu, g: ThreadGovernor, seconds: float) -> None:
    for _ in range(round(seconds / WINDOW_S)):
        cpu.advance()
        g.after_step()


def test_a_quiet_cpu_keeps_the_ceiling() -> None:
    cpu = FakeCpu()
    g = cpu.governor(4)
    _steps(cpu, g, 30)
    assert g.current == 4 and cpu.set_to == [4] and g.changes == 0


def test_contention_drops_a_thread_and_a_failed_try_doubles_the_hold() -> None:
    cpu = FakeCpu()
    g = cpu.governor(2)
    cpu.wait_ratio = 0.5  # two threads beside a busy loop on two cores
    _steps(cpu, g, WINDOW_S)
    assert g.current == 1 and cpu.set_to == [2, 1]
    cpu.wait_ratio = 0.0  # one thread beside it: no wait
    _steps(cpu, g, HOLD_S - WINDOW_S)
    assert g.current == 1, "held before trying again"
    _steps(cpu, g, WINDOW_S)
    assert g.current == 2  # the try
    cpu.wait_ratio = 0.5  # the neighbour is still there
    _steps(cpu, g, WINDOW_S)
    assert g.current == 1 and g.to_dict()["wait_ratio"] == 0.5
    cpu.wait_ratio = 0.0
    _steps(cpu, g, 2 * HOLD_S - WINDOW_S)
    assert g.current == 1, "the hold doubled after the failed try"
    _steps(cpu, g, WINDOW_S)
    assert g.current == 2
    _steps(cpu, g, 20)
    assert g.current == 2, "the neighbour left: the try holds"


def test_the_hold_stops_doubling_at_its_maximum() -> None:
    cpu = FakeCpu()
    g = cpu.governor(2)
    for _ in range(10):
        cpu.wait_ratio = 0.6
        _steps(cpu, g, WINDOW_S)  # a drop, or a failed try
        cpu.wait_ratio = 0.0
        _steps(cpu, g, MAX_HOLD_S + WINDOW_S)
        assert g.current == 2  # tried again within the longest hold
    assert g.changes == 20


def test_fixed_threads_and_a_missing_schedstat_never_change() -> None:
    cpu = FakeCpu()
    g = cpu.governor(2, adaptive=False)
    cpu.wait_ratio = 1.0
    _steps(cpu, g, 10)
    assert g.current == 2 and cpu.set_to == [2]
    g = ThreadGovernor(2, set_threads=cpu.set_to.append, clock=lambda: cpu.now, sample=lambda: None)
    g.start()
    _steps(cpu, g, 10)
    assert g.current == 2 and not g.adaptive


def test_an_idle_engine_is_not_judged() -> None:
    cpu = FakeCpu()
    g = cpu.governor(2)
    cpu.now += 10  # idle: no run time, nothing waited
    g.after_step()
    assert g.current == 2 and g.last_wait_ratio is None
    assert WAIT_LIMIT > 0


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="no /proc")
def test_schedstat_counts_this_process_threads() -> None:
    before = read_schedstat()
    if before is None:
        pytest.skip("this kernel keeps no schedstats")
    t = threading.Thread(target=lambda: sum(range(2_000_000)))
    t.start()
    t.join()
    after = read_schedstat()
    assert after is not None and after[0] > before[0] and after[1] >= before[1]


def test_the_engine_thread_sets_the_count(monkeypatch) -> None:
    """torch's count is per thread: the governor sets it on the thread that runs it (the engine's)."""
    import torch

    seen = []
    g = ThreadGovernor(1, reason="test")
    thread = threading.Thread(target=lambda: (g.start(), seen.append(torch.get_num_threads())))
    thread.start()
    thread.join()
    assert seen == [1] and cpu_threads.ThreadGovernor is ThreadGovernor
