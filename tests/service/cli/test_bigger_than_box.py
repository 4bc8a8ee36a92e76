"""A model bigger than its box, served with no flag but the model (issue 32), in a real memory cgroup: the server
measures the box and its own footprint, keeps what fits resident, reads the rest from the checkpoint's files, and
answers what plain transformers answers, without being OOM-killed. A box too small for one sequence exits 2 with
advice that names ``--cpu-quantization``, and that advice, applied, serves."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.memory_box import cgroup_unavailable, make_box
from tests.models import llama_100m_dir
from tests.service.cli.test_cli_serve import REPO, _env, _wait_ready
from tests.service.conftest import free_port

MiB = 2**20
why_not = cgroup_unavailable()

#: A box roomy enough for the 100M Llama's 425 MB of fp32 weights, the server process (torch, transformers, the
#: tokenizer, uvicorn) and one sequence's KV: the probe that measures what the tighter box must be.
ROOMY_BOX = 1536 * MiB
PROMPT = "The sea is"
NEW_TOKENS = 8


@contextmanager
def _served_in(box_limit: int, tmp_path: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``loadmaster serve`` of the 100M Llama (``flags`` added) in a fresh memory cgroup of ``box_limit`` bytes: its
    URL and process once ready. On the way out the server stops, the box goes, and no OOM kill may have happened."""
    box = make_box(box_limit)
    port = free_port()
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "service.cli", "serve", str(llama_100m_dir()), "--port", str(port), *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, preexec_fn=box.join())
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log, timeout=300, poll=0.5)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(60)
        kills = box.oom_kills()
        box.remove()
    assert kills == 0, log.read_text()[-3000:]


def _plan(url: str) -> dict:
    info = httpx.get(url + "/info", timeout=30).json()
    return info["model"]["plan"] if "model" in info and "plan" in info["model"] else info["plan"]


@pytest.fixture(scope="module")
def split_box(tmp_path_factory: pytest.TempPathFactory) -> int:
    """A box that holds the process, one sequence and about half the weights, measured rather than fixed: the
    process's own footprint was 373 MB on one machine and 461 MB on another, and a fixed 640 MiB box then left the
    second no room for a single resident block. The roomy box's plan gives the footprint (the limit less the CPU's
    capacity), one sequence's KV (its pool over its slots) and the activations of its step."""
    with _served_in(ROOMY_BOX, tmp_path_factory.mktemp("probe")) as (url, _):
        plan = _plan(url)
    cpu = next(b for b in plan["budgets"] if b["device"] == "cpu")
    assert cpu["weights"] == sum(b["weights"] for b in plan["budgets"]), "the roomy box holds every weight"
    footprint = ROOMY_BOX - cpu["capacity"]
    one_sequence = cpu["kv_cache"] // plan["workload"]["batch_size"]
    return footprint + one_sequence + cpu["activations"] + cpu["weights"] // 2


def _greedy_ids(url: str) -> list[int]:
    """The token ids a greedy ``/generate`` of the prompt returns."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def _reference_ids() -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(llama_100m_dir(), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(llama_100m_dir())
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.skipif(why_not is not None, reason=why_not or "")
def test_no_flag_serve_in_a_box_smaller_than_the_model_is_ready_correct_and_not_killed(
    split_box: int, tmp_path: Path
) -> None:
    with _served_in(split_box, tmp_path) as (url, proc):
        plan = _plan(url)
        devices = {b["device"]: b for b in plan["budgets"]}
        assert devices["disk"]["weights"] > 0 and devices["cpu"]["weights"] > 0, plan["budgets"]  # split, as planned
        assert devices["cpu"]["capacity"] < split_box, (
            "the plan's CPU capacity is the box minus the process's footprint"
        )
        assert _greedy_ids(url) == _reference_ids()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
            for s in family.samples
        }
        streamed = samples[("loadmaster_weights_bytes", (("device", "disk"), ("placement", "streamed")))]
        assert streamed == devices["disk"]["weights"]  # the offload runs as planned, and /metrics says so
        assert samples[("loadmaster_storage_read_bytes_per_token", ())] >= 0
        assert proc.poll() is None


@pytest.mark.skipif(why_not is not None, reason=why_not or "")
def test_an_int4_draft_copy_loads_in_the_box_and_keeps_greedy_tokens(split_box: int, tmp_path: Path) -> None:
    """``--speculate int4`` in the same box: the copy quantizes the model's weights from the shards' maps, so its
    load never holds the float model (it was OOM-killed here when it did); greedy tokens stay transformers'. With the
    draft's 57 MiB taken, one 2048-token sequence only just fits beside the process, and whether it does depends on
    the process's footprint that run; a 1024-token context leaves room, so the test is about the copy's load."""
    with _served_in(split_box, tmp_path, "--speculate", "int4", "--context", "1024") as (url, proc):
        info = httpx.get(url + "/info", timeout=30).json()
        assert info["speculation"]["draft_model"]["scheme"] == "int4"
        assert info["speculation"]["draft_tokens"] == 8  # the plan streams weights: more drafts a pass by default
        assert _greedy_ids(url) == _reference_ids()
        assert proc.poll() is None


def test_a_box_too_small_for_one_sequence_exits_2_and_its_cpu_quantization_advice_serves(tmp_path: Path) -> None:
    """Declared with ``--max-memory`` (a cgroup this small would hold no Python at all), the checkpoint's own files
    as the disk tier: 80 MiB is less than one sequence's floor in float32 (KV, activations, the embedding and one
    streamed block), so exit 2, one line of advice naming ``--cpu-quantization``; applying that advice serves."""
    argv = [sys.executable, "-m", "service.cli", "serve", str(llama_100m_dir()), "--max-memory", "cpu=80MiB"]
    p = subprocess.run([*argv, "--port", str(free_port())], capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    advice = [line for line in p.stderr.splitlines() if "does not fit" in line]
    assert len(advice) == 1, p.stderr[-3000:]
    match = re.search(r"--cpu-quantization (int8|int4)\) \(one stream: [0-9.]+ tokens/s\)", advice[0])
    assert match, advice[0]  # each option says what it would give, so the options can be weighed
    port = free_port()
    log = tmp_path / "advised.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, "--cpu-quantization", match.group(1), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc, log, timeout=300, poll=0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"inputs": PROMPT}, timeout=300)
        assert r.status_code == 200 and r.json()["generated_text"], r.text
    finally:
        proc.terminate()
        proc.wait(60)
