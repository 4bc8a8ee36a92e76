"""Each stage of a served pipeline is held as its stage plan says, through the ordinary loader: two real ranks
(gloo on loopback) whose stage 0 plan puts part of stage 0 on disk (a small ``--max-memory`` and an
``--offload-folder``) give plain transformers' greedy tokens, and ``--cpu-quantization int8 --cpu-kernels native``
on two ranks gives the one-process int8 server's tokens."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import text_generation

from tests.service.conftest import LiveServer, free_port, settings_for
from tests.service.pipeline.test_launch import SERVE_FLAGS, _start_ranks, _wait_ready

pytestmark = pytest.mark.slow

#: With these limits the cluster planner puts part of stage 0 (embeddings, head, two layers) on disk.
DISK_FLAGS = ["--max-memory", "cpu=2100KiB,disk=1GiB", "--max-total-tokens", "256", "--max-input-tokens", "128"]
PROMPTS = ["The old lighthouse keeper", "Hello there"]


def _run_ranks(model: Path, tmp_path: Path, flags: list[str]) -> tuple[str, list[subprocess.Popen]]:
    port = free_port()
    procs = _start_ranks(model, port, tmp_path, [[], []], flags=flags)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, procs, tmp_path / "rank0.log")
    return url, procs


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_stage_planned_partly_on_disk_serves_transformers_greedy_tokens(tiny_llama, reference, tmp_path) -> None:
    greedy, _ = reference
    flags = [*DISK_FLAGS, "--max-batch-size", "2", "--threads", "1", "--offload-folder", str(tmp_path / "offload")]
    url, procs = _run_ranks(tiny_llama, tmp_path, flags)
    try:
        client = text_generation.Client(url, timeout=120)
        for prompt in PROMPTS:
            assert [t.id for t in client.generate(prompt, max_new_tokens=6).details.tokens] == greedy(prompt, 6)
        stages = httpx.get(url + "/info").json()["pipeline"]["stages"]
        memory = stages[0]["memory"]
        assert memory["planned"]["disk"] > 0  # the plan keeps part of stage 0 on disk, and the stage did so:
        assert memory["measured"]["weights"] == memory["planned"]["weights"] > 0
        assert stages[1]["memory"]["measured"]["weights"] == stages[1]["memory"]["planned"]["weights"] > 0
    finally:
        _end(procs)


def test_int8_on_two_ranks_gives_the_one_process_int8_servers_tokens(tiny_llama, tmp_path) -> None:
    flags = [*SERVE_FLAGS, "--max-batch-size", "4", "--cpu-quantization", "int8", "--cpu-kernels", "native"]
    single = LiveServer(
        settings_for(
            tiny_llama,
            max_memory=["cpu=1GiB"],
            max_total_tokens=256,
            max_input_tokens=128,
            max_batch_size=4,
            cpu_quantization="int8",
            cpu_kernels="native",
        )
    ).start()
    try:
        url, procs = _run_ranks(tiny_llama, tmp_path, flags)
        try:
            piped = text_generation.Client(url, timeout=120)
            one = text_generation.Client(single.url, timeout=120)
            for prompt in PROMPTS:
                got = [t.id for t in piped.generate(prompt, max_new_tokens=6).details.tokens]
                assert got == [t.id for t in one.generate(prompt, max_new_tokens=6).details.tokens]
            quantized = httpx.get(url + "/info").json()["load_stats"]["cpu_quantization"]  # stage 0's load
            assert quantized["scheme"] == "int8" and quantized["layers"] > 0
        finally:
            _end(procs)
    finally:
        single.stop()
