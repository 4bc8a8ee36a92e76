"""``loadmaster serve MODEL --pipeline``: two real ranks (gloo on loopback), rank 0 serving HTTP on a real socket.

The pipelined server is started by ``torchrun`` as an operator starts it; TGI's ``text-generation`` client and the
``openai`` client get the same greedy tokens from it as from the one-process server (and plain transformers).
``/info`` and ``/metrics`` describe each stage. The failure tests start the ranks as plain processes with the
environment torchrun gives them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), so that rank 0's own reaction is what is
seen: torchrun would tear the group down itself the moment a rank dies.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import text_generation
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.service.conftest import free_port

pytestmark = pytest.mark.slow

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SERVE_FLAGS = ["--max-memory", "cpu=1GiB", "--max-total-tokens", "256", "--max-input-tokens", "128", "--threads", "1"]
PROMPTS = ["The old lighthouse keeper", "Hello there", "Once upon a time", "A"]


def _wait_ready(url: str, procs: list[subprocess.Popen], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            assert p.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def pipelined(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``torchrun --standalone --nproc-per-node 2 -m service.cli.main serve tiny-llama --pipeline``; its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("pipeline-serve") / "torchrun.log"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "service.cli", "serve", str(tiny_llama)]
    cmd += ["--pipeline", "--port", str(port), *SERVE_FLAGS]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, [proc], log)
        yield url
    finally:
        _stop(proc)  # torchrun passes SIGTERM to every rank (and then reports the signal in its own exit status)


def test_tgi_client_gets_the_one_process_servers_greedy_tokens(pipelined, server, reference) -> None:
    greedy, _ = reference
    piped = text_generation.Client(pipelined, timeout=120)
    single = text_generation.Client(server.url, timeout=120)
    out = piped.generate(PROMPTS[0], max_new_tokens=8, decoder_input_details=True)
    want = single.generate(PROMPTS[0], max_new_tokens=8, decoder_input_details=True)
    assert [t.id for t in out.details.tokens] == [t.id for t in want.details.tokens] == greedy(PROMPTS[0], 8)
    # the prompt's logprobs take the pipeline's cache-less forward
    assert [p.logprob for p in out.details.prefill[1:]] == pytest.approx(
        [p.logprob for p in want.details.prefill[1:]], abs=1e-4
    )
    streamed = [e.token.id for e in piped.generate_stream(PROMPTS[1], max_new_tokens=6)]
    assert streamed == greedy(PROMPTS[1], 6)


def test_concurrent_clients_are_batched_over_micro_batches_with_the_same_tokens(pipelined, server) -> None:
    async def run(url: str) -> list[list[int]]:
        client = text_generation.AsyncClient(url, timeout=120)
        outs = await asyncio.gather(*(client.generate(p, max_new_tokens=6) for p in PROMPTS))
        return [[t.id for t in o.details.tokens] for o in outs]

    before = httpx.get(pipelined + "/info").json()["pipeline"]["steps"]
    assert asyncio.run(run(pipelined)) == asyncio.run(run(server.url))
    assert httpx.get(pipelined + "/info").json()["pipeline"]["steps"] > before


def test_openai_client_gets_the_one_process_servers_text(pipelined, server) -> None:
    piped = openai.OpenAI(base_url=pipelined + "/v1", api_key="unused", max_retries=0)
    single = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="tiny-llama", prompt="Hello there", max_tokens=7, temperature=0)
    assert piped.completions.create(**kw).choices[0].text == single.completions.create(**kw).choices[0].text
    chat = dict(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
    a = piped.chat.completions.create(**chat).choices[0].message.content
    assert a == single.chat.completions.create(**chat).choices[0].message.content
    chunks = piped.chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a


def test_info_and_metrics_describe_every_stage(pipelined, tiny_llama) -> None:
    httpx.post(pipelined + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, timeout=120)
    info = httpx.get(pipelined + "/info").json()
    stages = info["pipeline"]["stages"]
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert [s["rank"] for s in stages] == [0, 1]
    covered = [i for s in stages for i in range(s["layers"][0], s["layers"][1] + 1)]
    assert covered == list(range(layers))  # each layer on exactly one stage, in order
    for s in stages:
        assert s["num_layers"] == s["layers"][1] - s["layers"][0] + 1
        assert s["memory"]["measured"]["weights"] == s["memory"]["planned"]["weights"] > 0
        assert s["memory"]["measured"]["kv_cache"] > 0
        assert 0 < s["busy_fraction"] <= 1
    metrics = httpx.get(pipelined + "/metrics").text
    for s in stages:
        line = next(
            x
            for x in metrics.splitlines()
            if x.startswith(f'loadmaster_pipeline_stage_busy_fraction{{stage="{s["stage"]}"}}')
        )
        assert 0 < float(line.split()[-1]) <= 1
    assert 'loadmaster_pipeline_stage_layers{stage="1"}' in metrics


# -- failure: ranks started as torchrun starts them, without torchrun's own teardown --------------------------------
def _start_ranks(
    model: Path, port: int, log_dir: Path, per_rank: list[list[str]], flags: list[str] = SERVE_FLAGS
) -> list[subprocess.Popen]:
    master = str(free_port())
    procs = []
    for rank, extra in enumerate(per_rank):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(per_rank)))
        cmd = [sys.executable, "-m", "service.cli", "serve", str(model), "--pipeline", "--port", str(port)]
        with open(log_dir / f"rank{rank}.log", "w") as out:
            procs.append(subprocess.Popen([*cmd, *flags, *extra], stdout=out, stderr=subprocess.STDOUT, env=env))
    return procs


def test_a_killed_rank_fails_requests_in_flight_and_rank_0_exits(tiny_gpt2, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # no --max-memory: each rank detects its memory at its own moment; rank 0's plan, broadcast, is the one used
    no_memory = [f for f in SERVE_FLAGS if f not in ("--max-memory", "cpu=1GiB")]
    procs = _start_ranks(tiny_gpt2, port, tmp_path, [["--pipeline-timeout", "20"]] * 2, flags=no_memory)
    try:
        _wait_ready(url, procs, tmp_path / "rank0.log")
        # the GPT-2 tied head, computed on rank 0 after the hidden states come back around the ring
        model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(tiny_gpt2)
        ids = tok("the cat sat", return_tensors="pt")
        ref = model.generate(**ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = text_generation.Client(url, timeout=120).generate("the cat sat", max_new_tokens=6)
        assert [t.id for t in out.details.tokens] == ref[0, ids["input_ids"].shape[1] :].tolist()

        events = []
        with httpx.Client(timeout=120) as c:
            body = {"inputs": "the cat", "parameters": {"max_new_tokens": 200}}
            with c.stream("POST", url + "/generate_stream", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    events.append(json.loads(line[len("data:") :]))
                    if len(events) == 2:
                        procs[1].kill()
                        killed_at = time.monotonic()
                    if "error" in events[-1]:
                        break
        assert "error" in events[-1], events[-3:]
        assert "pipeline rank 1" in events[-1]["error"] and events[-1]["error_type"] == "not_ready"
        ready = httpx.get(url + "/health/ready", timeout=5)
        assert ready.status_code == 503 and "pipeline rank 1" in ready.json()["error"]
        procs[0].wait(timeout=max(1.0, 30 - (time.monotonic() - killed_at)))
        assert time.monotonic() - killed_at < 30
        assert procs[0].returncode not in (0, None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_three_ranks_serve_gpt2s_greedy_tokens_and_a_sigterm_stops_every_rank_cleanly(tiny_gpt2, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = _start_ranks(tiny_gpt2, port, tmp_path, [[]] * 3)
    try:
        _wait_ready(url, procs, tmp_path / "rank0.log")
        model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(tiny_gpt2)
        client = text_generation.Client(url, timeout=120)
        for prompt in ("hello world", "the cat sat on"):
            ids = tok(prompt, return_tensors="pt")
            ref = model.generate(**ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            got = [t.id for t in client.generate(prompt, max_new_tokens=6).details.tokens]
            assert got == ref[0, ids["input_ids"].shape[1] :].tolist()
        stages = httpx.get(url + "/info").json()["pipeline"]["stages"]
        assert [s["rank"] for s in stages] == [0, 1, 2] and all(s["num_layers"] >= 1 for s in stages)
        procs[0].send_signal(signal.SIGTERM)  # rank 0 drains, then tells the other ranks to stop
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [0, 0, 0], [(tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(3)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_rank_started_with_other_flags_is_refused_with_one_line(tiny_llama, tmp_path) -> None:
    procs = _start_ranks(tiny_llama, free_port(), tmp_path, [[], ["--max-batch-size", "3"]])
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(c not in (0, None) for c in codes)
    line = next(x for x in (tmp_path / "rank1.log").read_text().splitlines() if "loadmaster: error" in x)
    assert "rank 1 was started with a different max_batch_size '3' (rank 0: '32')" in line
    assert "rank 1 was started with a different max_batch_size" in (tmp_path / "rank0.log").read_text()


def test_pipeline_without_torchrun_and_pipeline_flags_without_pipeline_are_refused(tiny_llama) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    base = [sys.executable, "-m", "service.cli", "serve", str(tiny_llama)]
    r = subprocess.run([*base, "--pipeline"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "under torchrun" in r.stderr
    r = subprocess.run([*base, "--inter-host-bandwidth", "1Gb"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "add --pipeline" in r.stderr
    # --micro-batches alone is the device pipeline's; on a plan without several GPUs the load is refused by name
    r = subprocess.run(
        [*base, "--micro-batches", "2", "--port", "0"], capture_output=True, text=True, timeout=240, env=env
    )
    assert r.returncode not in (0, 2) and "--micro-batches 2 (LOADMASTER_MICRO_BATCHES)" in r.stdout + r.stderr
    ranked = {**env, "RANK": "0", "WORLD_SIZE": "2"}
    demo = [sys.executable, "-m", "service.cli", "demo", "--pipeline"]
    r = subprocess.run(demo, capture_output=True, text=True, timeout=120, env=ranked)
    assert r.returncode == 2 and "the demo serves one process" in r.stderr
