"""The garbage collector's pause while the server starts (:mod:`service.cli.startup_gc`): paused once, resumed once
with the start's objects frozen, left alone where someone else turned it off, and always resumed by the end of the
command, in a real ``loadmaster serve`` as in a refused one."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.cli import startup_gc
from service.cli.main import main
from tests.service.cli.test_cli_serve import REPO, _env, _wait_ready
from tests.service.conftest import free_port


@pytest.fixture
def collector() -> Iterator[None]:
    """Each test starts with the collector on and nothing frozen, and leaves it so."""
    was = gc.isenabled()
    gc.enable()
    gc.unfreeze()
    yield
    startup_gc.resume_collection()
    gc.unfreeze()
    if not was:
        gc.disable()


def test_pause_then_resume_freezes_the_start(collector: None) -> None:
    assert startup_gc.pause_collection() is True
    assert not gc.isenabled()
    assert startup_gc.pause_collection() is False  # one pause: a second asks nothing more
    made = [[i] for i in range(1000)]  # objects of "the start"
    assert startup_gc.resume_collection() is True
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)  # moved where collections no longer walk them
    assert startup_gc.resume_collection() is False  # resumed once only


def test_the_pause_ends_by_its_limit_if_the_load_has_not(collector: None) -> None:
    assert startup_gc.pause_collection(limit_s=0.2) is True
    deadline = time.monotonic() + 30
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gc.isenabled()
    assert startup_gc.resume_collection() is False  # already ended by the limit


def test_an_earlier_pause_limit_does_not_end_a_later_pause(collector: None) -> None:
    assert startup_gc.pause_collection(limit_s=0.2) is True
    assert startup_gc.resume_collection() is True
    assert startup_gc.pause_collection(limit_s=30) is True
    time.sleep(0.6)  # the first pause's timer has fired by now
    assert not gc.isenabled()
    assert startup_gc.resume_collection() is True


def test_a_collector_turned_off_by_someone_else_stays_off(collector: None) -> None:
    gc.disable()
    with startup_gc.paused_during_start():
        assert not gc.isenabled()
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0
    gc.enable()


def test_a_refused_serve_leaves_the_collector_on(collector: None, tmp_path: Path) -> None:
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert gc.isenabled()


def test_a_real_server_resumes_collection_when_its_model_is_ready(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    argv = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        str(tiny_llama),
        "--port",
        str(port),
        "--log-level",
        "debug",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc, log, timeout=120, poll=0.1)
        r = httpx.post(
            f"http://127.0.0.1:{port}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = log.read_text().splitlines()
    resumed = [i for i, line in enumerate(lines) if "garbage collection resumed" in line]
    ready = [i for i, line in enumerate(lines) if "ready in" in line]
    assert len(resumed) == 1 and ready and resumed[0] < ready[0], "\n".join(lines[-40:])
