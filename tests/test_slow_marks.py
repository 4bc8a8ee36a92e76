"""The ``slow`` mark follows what a test uses: its own code, the helpers it calls, its fixtures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import _starts_something

SAMPLE = """
import subprocess


def spawn():
    return subprocess.run(["true"])


def indirect():
    return spawn()


def pure(x):
    return x + 1


def calls_pure():
    return pure(1)


def recursive(n):
    return recursive(n - 1) if n else 0


def test_spawns():
    indirect()
"""


def _sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "slow_sample_module.py"
    path.write_text(SAMPLE)
    spec = importlib.util.spec_from_file_location("slow_sample_module", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_subprocess_two_helpers_down_makes_a_test_slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    m = _sample(tmp_path, monkeypatch)
    assert _starts_something(m.spawn, set())
    assert _starts_something(m.test_spawns, set())


def test_pure_code_and_recursion_are_not_slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    m = _sample(tmp_path, monkeypatch)
    assert not _starts_something(m.calls_pure, set())
    assert not _starts_something(m.recursive, set())
    assert not _starts_something(len, set())  # builtins have no source to read
