"""Progress goes to a terminal as a bar and to a log as a few lines (a bar would write a redraw per step there)."""

from __future__ import annotations

import io
import logging

import pytest

from loaders.checkpoint import load_progress
from loaders.checkpoint.load_progress import LogProgress, ProgressReporter, progress_bar


def test_a_redirected_stderr_gets_log_lines_and_a_terminal_gets_the_bar(monkeypatch) -> None:
    log = logging.getLogger("test.progress")
    monkeypatch.setattr(load_progress, "_stderr_is_terminal", lambda: False)
    assert isinstance(progress_bar(10, "x", "steps", log), LogProgress)
    monkeypatch.setattr(load_progress, "_stderr_is_terminal", lambda: True)
    bar = progress_bar(10, "x", "steps", log)
    assert not isinstance(bar, LogProgress) and hasattr(bar, "update")
    bar.close()
    assert getattr(progress_bar(10, "x", "steps", log, show=False), "disable", False)


def test_log_progress_writes_a_line_per_interval_not_per_step(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(load_progress.time, "monotonic", lambda: clock[0])
    log = logging.getLogger("test.progress")
    bar = LogProgress(400, "training demo model", "steps", log, every_s=10.0)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for step in range(1, 401):  # 400 steps over 40 s: a line every 10 s and one at the end, not 400 redraws
            clock[0] = step / 10
            bar.set_postfix(loss="3.210")
            bar.update(1)
        bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert 3 <= len(lines) <= 5, lines
    assert lines[0].startswith("training demo model: 100 steps of 400 steps (25%) so far") and "loss 3.210" in lines[0]
    assert lines[-1] == "training demo model: 400 steps of 400 steps (100%) done, 40 s, 10.0 steps/s, loss 3.210"


def test_the_load_reporter_logs_bytes_when_not_on_a_terminal(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    monkeypatch.setattr(load_progress, "_stderr_is_terminal", lambda: False)
    monkeypatch.setattr(load_progress, "LOG_EVERY_S", 0.0)
    monkeypatch.setattr(load_progress.sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger=load_progress.log.name):
        reporter = ProgressReporter(3 << 20, None, show_bar=True)
        reporter._bar.every_s = 0.0
        reporter.advance(1 << 20)
        reporter.close()
    assert any("loading: 1.0MiB of 3.0MiB (33%)" in r.getMessage() for r in caplog.records), caplog.text
