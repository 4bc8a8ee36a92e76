"""``loadmaster serve --speculate ngram|int8`` as a real process: greedy requests draft, /metrics and /info show the
drafts the model accepted, and /info the plan's speculative rate at that acceptance (issue 35)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.service.cli.test_cli_serve import REPO, _env, _wait_ready
from tests.service.conftest import free_port


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


@contextmanager
def _serving(model: Path, tmp_path: Path, *flags: str) -> Iterator[str]:
    """``loadmaster serve model *flags`` on a free port until the block ends; its URL once ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "service.cli", "serve", str(model), "--port", str(port), *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    try:
        _wait_ready(url, proc, log, timeout=120, poll=0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_server_with_ngram_speculation_reports_accepted_drafts(tiny_llama: Path, tmp_path: Path) -> None:
    with _serving(tiny_llama, tmp_path, "--speculate", "ngram", "--speculate-tokens", "3") as url:
        body = {"inputs": "one two three one two three one two three", "parameters": {"max_new_tokens": 40}}
        r = httpx.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(url + "/metrics").text
        proposed = _metric(metrics, "loadmaster_speculative_draft_tokens_total")
        accepted = _metric(metrics, "loadmaster_speculative_accepted_tokens_total")
        assert _metric(metrics, "loadmaster_speculative_verify_passes_total") > 0
        assert 0 < accepted <= proposed
        info = httpx.get(url + "/info").json()["speculation"]
        assert info["mode"] == "ngram" and info["draft_tokens"] == 3
        assert info["accepted"] == accepted and info["acceptance_rate"] > 0


def test_info_predicts_the_draft_copys_rate_at_the_measured_acceptance(tiny_llama: Path, tmp_path: Path) -> None:
    """The plan predicts one stream's rate with its int8 copy at the stated default acceptance; /info redoes it at
    the acceptance the server measured (planner.placement.speculative_rate)."""
    with _serving(tiny_llama, tmp_path, "--speculate", "int8", "--speculate-tokens", "3") as url:
        info = httpx.get(url + "/info").json()
        plan = info["plan"]
        assert plan["workload"]["draft"]["tokens"] == 3
        assert plan["prediction"]["speculative_acceptance"] == 0.7
        assert plan["prediction"]["speculative_tokens_per_s"] > 0
        spec = info["speculation"]
        assert spec["acceptance_rate"] is None  # nothing drafted yet: the plan's own figure
        assert spec["predicted_at_acceptance"] == 0.7
        assert spec["predicted_tokens_per_s"] == plan["prediction"]["speculative_tokens_per_s"]
        body = {"inputs": "one two three one two three", "parameters": {"max_new_tokens": 24}}
        assert httpx.post(url + "/generate", json=body, timeout=120).status_code == 200
        spec = httpx.get(url + "/info").json()["speculation"]
        if spec["proposed"]:
            assert spec["predicted_at_acceptance"] == spec["acceptance_rate"]
        assert spec["predicted_tokens_per_s"] > 0
