"""The thread governor from fake contention and fake step times: contention makes it try one thread fewer, and
speed decides. A try is kept only when its decode steps run faster than the same-width steps before it; a failed
try goes back and doubles the hold before the next; a try at a lower count tries one more after a hold."""

from __future__ import annotations

import os
import threading

import pytest

from loaders.native import cpu_threads
from loaders.native.cpu_threads import (
    HOLD_S,
    MAX_HOLD_S,
    TRIAL_MAX_S,
    WAIT_LIMIT,
    WINDOW_S,
    StepClock,
    ThreadGovernor,
    read_schedstat,
    width_bucket,
)


class FakeCpu:
    """A clock, a schedstat whose run-queue wait per second run the test sets, and decode steps whose seconds
    depend on the thread count the governor last set (``step_s``) and on the batch width."""

    def __init__(self) -> None:
        self.now = 0.0
        self.ran = 0.0
        self.waited = 0.0
        self.wait_ratio = 0.0
        self.step_s = {1: 0.02, 2: 0.012, 4: 0.008}  # a quiet machine: more threads, faster steps
        self.rows = 1
        self.set_to: list[int] = []

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

    def run(self, g: ThreadGovernor, seconds: float, decode: bool = True) -> None:
        """Steps for ``seconds`` of fake time: decode steps, or (``decode=False``) prefill steps of 0.1 s, which
        time no try."""
        end = self.now + seconds
        while self.now < end:
            step = self.step_s[self.set_to[-1]] * (1 + self.rows / 64) if decode else 0.1
            self.now += step
            self.ran += step
            self.waited += step * self.wait_ratio
            if decode:
                g.decode_step(self.rows, step)
            else:
                g.mixed_step()
            g.after_step()


def test_a_quiet_cpu_keeps_the_ceiling() -> None:
    cpu = FakeCpu()
    g = cpu.governor(4)
    cpu.run(g, 30)
    assert g.current == 4 and cpu.set_to == [4] and g.changes == 0 and g.last_trial is None


def test_a_busy_neighbour_drops_a_thread_and_a_failed_try_doubles_the_hold() -> None:
    cpu = FakeCpu()
    g = cpu.governor(2)
    cpu.wait_ratio, cpu.step_s[2] = 0.5, 0.3  # two threads beside a busy loop on two cores: 15x slower steps
    cpu.run(g, 3 * WINDOW_S)  # a window with the baseline steps a try is judged against, then the try
    assert g.current == 1 and cpu.set_to == [2, 1] and g.last_trial.kept and g.last_trial.to_threads == 1
    cpu.wait_ratio = 0.0  # one thread beside it: no wait
    cpu.run(g, HOLD_S - 2 * WINDOW_S)
    assert cpu.set_to == [2, 1], "held before trying again"
    cpu.run(g, 2 * WINDOW_S + TRIAL_MAX_S)
    assert cpu.set_to == [2, 1, 2, 1], "a try of one more, and back"
    assert not g.last_trial.kept and g.last_trial.time_ratio > 10 and g.changes == 1
    cpu.run(g, 2 * HOLD_S - TRIAL_MAX_S - WINDOW_S)
    assert cpu.set_to == [2, 1, 2, 1], "the hold doubled after the failed try"
    cpu.step_s[2] = 0.012  # the neighbour left
    cpu.run(g, 2 * TRIAL_MAX_S)
    assert g.current == 2 and g.last_trial.kept and g.changes == 2
    cpu.run(g, 20)
    assert g.current == 2 and cpu.set_to == [2, 1, 2, 1, 2], "the try holds"


def test_waiting_threads_that_are_still_faster_are_kept() -> None:
    """A neighbour that takes part of a core (a benchmark client): the threads wait for a CPU, yet two still run
    faster than one, so every try of one goes back, less and less often."""
    cpu = FakeCpu()
    g = cpu.governor(2)
    cpu.wait_ratio = 0.4
    cpu.run(g, 2 * WINDOW_S)
    assert cpu.set_to == [2, 1, 2], "contention: a try of one, and back"
    assert not g.last_trial.kept and g.last_trial.time_ratio > 1 and g.changes == 0
    tries = []
    for _ in range(12):
        before = len(cpu.set_to)
        cpu.run(g, MAX_HOLD_S)
        tries.append((len(cpu.set_to) - before) // 2)
    assert g.current == 2 and g.changes == 0
    assert tries[-1] == 1, "the hold stopped doubling at its maximum: a try every MAX_HOLD_S"
    assert sum(tries) < 20


def test_a_wider_batch_than_the_try_saw_ends_the_hold() -> None:
    """A lone stream on a busy CPU: one thread is as fast as two for 1-row steps, so the drop is kept. Then a wave of
    16 arrives: a width the try never saw ends the hold and restores two threads at once, instead of after up to a
    minute at one."""
    cpu = FakeCpu()
    g = cpu.governor(2)
    cpu.wait_ratio, cpu.step_s[2] = 0.5, 0.03  # 1-row steps: two threads beside a neighbour are slower
    cpu.run(g, 2 * WINDOW_S)
    assert g.current == 1 and g.last_trial.kept
    cpu.run(g, 3 * HOLD_S)
    assert g.current == 1, "still 1 row a step: the up-tries fail and the hold grows"
    cpu.wait_ratio, cpu.rows, cpu.step_s[2] = 0.0, 16, 0.012  # a wave: two threads are faster again
    g.decode_step(16, 0.02)
    assert g.current == 2 and cpu.set_to[-1] == 2, "back to the ceiling at the first wider step"
    cpu.run(g, 3 * HOLD_S)
    assert g.current == 2


def test_no_try_starts_without_steps_to_judge_it() -> None:
    """Only pure decode steps time a try. With none yet at the current width (prefill steps, or a wave's first
    steps) no try starts: it would run at the tried count until TRIAL_MAX_S with nothing to be judged against."""
    cpu = FakeCpu()
    g = cpu.governor(2)
    cpu.wait_ratio = 0.5
    cpu.run(g, 4 * WINDOW_S, decode=False)
    assert cpu.set_to == [2] and g.last_trial is None
    cpu.run(g, 2 * WINDOW_S)  # 1-row steps: a baseline, then a try
    assert cpu.set_to[:2] == [2, 1]


def test_a_prompt_step_ends_a_try_unjudged() -> None:
    """A try that started on a lone stream's steps meets a wave's prefill: the prefill runs at the count before
    the try, not at the tried one, and the try is left unjudged (no doubling of the hold)."""
    cpu = FakeCpu()
    g = cpu.governor(2)
    cpu.wait_ratio = 0.4
    while not g.to_dict()["trying"]:
        cpu.run(g, 0.05)
    assert cpu.set_to[-1] == 1
    cpu.run(g, 0.1, decode=False)
    assert g.current == 2 and cpu.set_to[-1] == 2 and not g.to_dict()["trying"]
    assert g.last_trial.time_ratio is None and not g.last_trial.kept
    cpu.run(g, 2 * WINDOW_S, decode=False)
    assert cpu.set_to[-1] == 2, "no try starts after a prompt step"


def test_a_try_is_judged_at_equal_width() -> None:
    """Wider steps cost more: a batch that grows during a try compares with the wide steps before it."""
    clock = StepClock()
    for rows, seconds in [(1, 0.010), (1, 0.010), (16, 0.030), (16, 0.030)]:
        clock.add(rows, seconds, trying=False)
    for rows, seconds in [(16, 0.027), (15, 0.027), (9, 0.027), (1, 0.009)]:
        clock.add(rows, seconds, trying=True)
    assert width_bucket(1) == 0 and width_bucket(9) == width_bucket(16) == 4 and width_bucket(8) == 3
    assert clock.matched() == pytest.approx([0.9, 0.9, 0.9, 0.9])  # not 2.7: the 16-row steps match their own
    clock.restart()
    assert len(clock.baseline) == 4 and not clock.trial


def test_fixed_threads_and_a_missing_schedstat_never_change() -> None:
    cpu = FakeCpu()
    g = cpu.governor(2, adaptive=False)
    cpu.wait_ratio, cpu.step_s[2] = 1.0, 1.0
    cpu.run(g, 10)
    assert g.current == 2 and cpu.set_to == [2]
    g = ThreadGovernor(2, set_threads=cpu.set_to.append, clock=lambda: cpu.now, sample=lambda: None)
    g.start()
    cpu.run(g, 10)
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
