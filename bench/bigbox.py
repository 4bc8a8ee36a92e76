"""Bigger than the box (issue 32): a model larger than its memory cgroup, served with no flag, cold cache, vs peers.

A checkpoint larger than the memory the server may use, served with no flag but the model, from a cold page cache,
side by side with accelerate and llama.cpp in the same box.

    .venv/bin/python -m bench.bigbox --model DIR                           # 3 GiB and 1.5 GiB boxes, best of 3
    .venv/bin/python -m bench.bigbox --model DIR --box 3GiB --peers accelerate,llamacpp --out bench/results/bigbox.json
    .venv/bin/python -m bench.bigbox --model DIR --box 640MiB --repeat 1 --new-tokens 8 --clients 4 --peers ""

Needs root: the bench makes the box itself, a real memory cgroup per run (v2 ``memory.max`` where the unified
hierarchy has the memory controller, else v1 ``memory.limit_in_bytes``; :mod:`bench.memory_box`), removed after the
run even when it fails. Every contender starts in a fresh box of ``--box`` bytes (``preexec_fn`` joins it before
anything runs), so its OOM kills and peak usage are its own; the clients, the bench and the transformers reference
run outside the box.

Method:

- **Disk.** The checkpoint's own shards are read once with ``O_DIRECT`` (page cache bypassed), best of
  ``--repeat``; where ``O_DIRECT`` is refused, a buffered read after ``POSIX_FADV_DONTNEED``
  (:func:`loaders.checkpoint.disk_rate.cold_read_rate`). The **ideal** for a box: that rate ÷ (checkpoint bytes − (box −
  1 GiB)) tokens/s, 1 GiB being the process, KV cache and activations; the rest of the weights resident, the
  remainder read from disk once per token. A checkpoint that fits in box − 1 GiB is "resident" (no disk ideal).
  The shards are also read whole as the disk tier streams them (:func:`~loaders.checkpoint.disk_rate.
  streamed_read_rate`, the server's probe), and that rate is reported beside the direct one.
- **Cold cache.** Before each contender: ``sync; echo 3 > /proc/sys/vm/drop_caches``, or where that is refused
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of the checkpoint.
- **loadmaster.** ``python -m service.cli serve MODEL --port P`` and nothing else (``HF_HUB_OFFLINE=1``); time to
  ready (``GET /health/ready`` == 200, from the spawn). One stream: ``POST /generate_stream`` of a fixed prompt,
  greedy, ``--new-tokens`` tokens; decode tokens/s = (n − 1) ÷ (time of the last token − time of the first). Then
  ``--clients`` streams at once, one per thread, each one greedy request of ``--new-tokens`` on its own prompt
  (:func:`bench.serve.prompts`): aggregate tokens/s = tokens generated ÷ wall time (their prompts' prefill included),
  and the aggregate decode rate while all of them decode (:func:`concurrent_decode_rate`), set against the plan's
  prediction for that many sequences at once (``plan.prediction.concurrent``). ``GET /info`` gives the
  plan's predicted decode tokens/s of one stream (``plan.prediction.lone_decode_tokens_per_s``), ``GET /metrics`` the storage bytes
  read per token and the resident/streamed weights per device.
- **accelerate.** In a fresh process in the same box: ``AutoModelForCausalLM.from_pretrained(MODEL,
  device_map="auto", offload_folder=TMP, dtype=float32)``, then greedy ``generate`` of the same prompt, timed per
  token by a streamer (same decode formula). An OOM kill is reported as such.
- **llama.cpp** (``--peers llamacpp``, off by default: the binding compiles for minutes on first use). The same
  weights written once as f32 GGUF (:mod:`bench.peers.llamacpp`, outside the box), then in a fresh process in the
  box: loaded with llama.cpp's defaults (``use_mmap`` on), the same prompt ids, greedy, one stream.
- **Greedy check.** After every server and peer has run, plain transformers ``generate(do_sample=False)`` on the
  same weights, in this process (outside the box), gives the reference tokens; each contender's one-stream tokens
  are compared from the first: "yes (k/n)" when all agree.

Every figure is the best of ``--repeat`` runs (ready: min; tokens/s: max); OOM kills are summed and peak usage
is the largest over the runs. The table goes to stdout, every run's values to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULT_PREFIX, ROOT, drop_cache, emit, machine, print_table, run_together, write_json
from bench.memory_box import MemoryBox, cgroup_unavailable, make_box
from loaders.checkpoint.disk_rate import DiskRate, cold_read_rate, streamed_read_rate
from planner.hardware.units import format_bytes, parse_size

GiB = 1 << 30
PROMPT = "The history of the sea is"
PEERS = ("accelerate", "llamacpp")


# -- results -------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One contender, one run, in one fresh box."""

    contender: str
    box: int
    ready_s: float | None = None
    one_stream_tok_s: float | None = None
    clients_tok_s: float | None = None
    #: The clients' aggregate rate while every one of them decodes (:func:`concurrent_decode_rate`).
    clients_decode_tok_s: float | None = None
    predicted_tok_s: float | None = None
    #: The plan's predicted aggregate decode rate for that many sequences at once (``prediction.concurrent``).
    predicted_clients_tok_s: float | None = None
    storage_bytes_per_token: float | None = None
    storage_bytes_per_token_clients: float | None = None
    weights_bytes: dict[str, int] = field(default_factory=dict)
    #: The sequences the plan's KV pool lets the server run at once (``/info``'s ``limits.max_batch_size``).
    batch_slots: int | None = None
    #: Speculative decoding's counters after the one stream (``--speculate``): draft tokens, accepted, verify passes.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    oom_kills: int = 0
    peak: int = -1
    cache_drop: str = ""
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class Row:
    """The best of a contender's runs in one box, against the box's ideal and the transformers reference."""

    box: str
    contender: str
    ready_s: float | None
    one_stream_tok_s: float | None
    clients_tok_s: float | None
    clients_decode_tok_s: float | None
    ideal_tok_s: float | None
    ratio_to_ideal: float | None
    predicted_tok_s: float | None
    prediction_error_pct: float | None
    predicted_clients_tok_s: float | None
    clients_prediction_error_pct: float | None
    storage_bytes_per_token: float | None
    #: Accepted over proposed draft tokens in the best run (None without speculation).
    acceptance: float | None
    tokens_per_pass: float | None
    oom_kills: int
    peak: int
    greedy: str
    error: str | None
    runs: list[Run]


# -- the box, the cache and the disk -------------------------------------------------------------------------------
@contextmanager
def boxed(limit: int) -> Iterator[MemoryBox]:
    """A fresh memory cgroup of ``limit`` bytes, removed on the way out (its processes must have exited)."""
    box = make_box(limit)
    try:
        yield box
    finally:
        box.remove()


def shards(model: Path) -> list[Path]:
    """The checkpoint's weight files."""
    return sorted(model.glob("*.safetensors")) or sorted(model.glob("*.bin"))


def cold_cache(model: Path) -> str:
    """Drop the page cache: the whole of it where root may (``drop_caches``), else the checkpoint's files."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        drop_cache([f for f in model.rglob("*") if f.is_file()])
        return "fadvise"


def disk_rate(model: Path, repeats: int) -> DiskRate:
    """The device's read rate of the checkpoint's shards, whole, ``O_DIRECT``, best of ``repeats``: the ideal's."""
    files = shards(model)
    return max((cold_read_rate(files) for _ in range(max(1, repeats))), key=lambda r: r.bytes_per_s)


def streamed_rate(model: Path, repeats: int) -> DiskRate:
    """The shards read whole as the disk tier streams them (mapped, read ahead), best of ``repeats``: how the
    server's start-up probe reads, reported beside the direct rate so that a prediction's error can be told apart
    from the disk's swings."""
    files = shards(model)
    size = sum(f.stat().st_size for f in files)
    return max((streamed_read_rate(files, size) for _ in range(max(1, repeats))), key=lambda r: r.bytes_per_s)


def ideal_tok_s(rate: float, checkpoint: int, box: int) -> float | None:
    """Disk rate ÷ the bytes a token must read when box − 1 GiB holds weights resident; None when all fit."""
    streamed = checkpoint - max(0, box - GiB)
    return rate / streamed if streamed > 0 else None


# -- timing --------------------------------------------------------------------------------------------------------
def decode_rate(stamps: list[float]) -> float | None:
    """(n − 1) ÷ (last − first): the decode rate without the first token (prefill)."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def box_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))


def stop(proc: subprocess.Popen) -> None:
    """Terminate a child, then kill it if it does not exit within a minute."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- loadmaster ----------------------------------------------------------------------------------------------------
def stream_one(url: str, new_tokens: int, prompt: str = PROMPT) -> tuple[list[int], list[float]]:
    """One greedy ``/generate_stream`` of ``prompt``: the token ids and each token's arrival time."""
    import httpx

    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "do_sample": False}}
    ids: list[int] = []
    stamps: list[float] = []
    with httpx.Client(base_url=url, timeout=None) as c, c.stream("POST", "/generate_stream", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            stamps.append(time.perf_counter())
            ids.append(int(event["token"]["id"]))
    return ids, stamps


@dataclass(frozen=True)
class ClientsRates:
    """``clients`` greedy streams at once: tokens ÷ wall time (their prompts' prefill included), and the aggregate
    rate while every one of them decodes."""

    tokens_per_s: float
    decode_tokens_per_s: float | None


def concurrent_decode_rate(stamps: list[list[float]]) -> float | None:
    """Tokens of every stream that arrived after the last stream's first token and up to the first stream's last
    token, over that time: the aggregate decode rate of all the streams at once, their prompts excluded (what the
    plan's concurrent prediction is for). None where no such window exists."""
    if not stamps or any(len(s) < 2 for s in stamps):
        return None
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if end <= start:
        return None
    return sum(1 for s in stamps for t in s if start < t <= end) / (end - start)


def clients_rate(url: str, clients: int, new_tokens: int) -> ClientsRates:
    """``clients`` greedy streams at once, one per thread, each on its own prompt (:func:`bench.serve.prompts`)."""
    import threading

    from bench.serve import prompts

    stamps: list[list[float]] = [[] for _ in range(clients)]
    errors: list[str] = []

    def client(i: int, text: str) -> None:
        try:
            stamps[i] = stream_one(url, new_tokens, text)[1]
        except Exception as e:  # recorded; the run reports the first
            errors.append(f"{type(e).__name__}: {e}")

    wall = run_together([threading.Thread(target=client, args=(i, t)) for i, t in enumerate(prompts(clients))])
    if errors:
        raise RuntimeError(f"{len(errors)} client requests failed: {errors[0]}")
    return ClientsRates(sum(len(s) for s in stamps) / wall, concurrent_decode_rate(stamps))


def predicted_concurrent_rate(info: dict[str, Any], sequences: int) -> float | None:
    """The plan's predicted aggregate decode tokens/s of ``sequences`` at once from ``GET /info``, if it states it."""
    plan = info.get("plan") or (info.get("model") or {}).get("plan") or {}
    rates = (plan.get("prediction") or {}).get("concurrent") or []
    return next((c["tokens_per_s"] for c in rates if c.get("sequences") == sequences), None)


def predicted_rate(info: dict[str, Any]) -> float | None:
    """The plan's predicted decode tokens/s of one stream alone from ``GET /info`` (the plan's own figure is for its
    whole batch of slots)."""
    speculative = (info.get("speculation") or {}).get("predicted_tokens_per_s")
    if speculative:  # with a draft model: the plan's speculative rate at the acceptance measured so far
        return speculative
    plan = info.get("plan") or (info.get("model") or {}).get("plan") or {}
    prediction = plan.get("prediction") or {}
    return prediction.get("lone_decode_tokens_per_s") or prediction.get("decode_tokens_per_s")


def storage_metrics(samples: list) -> tuple[float | None, dict[str, int]]:
    """``loadmaster_storage_read_bytes_per_token`` and ``loadmaster_weights_bytes`` by "device/placement"."""
    per_token: float | None = None
    weights: dict[str, int] = {}
    for s in samples:
        if s.name == "loadmaster_storage_read_bytes_per_token":
            per_token = s.value
        elif s.name == "loadmaster_weights_bytes":
            weights[f"{s.labels['device']}/{s.labels['placement']}"] = int(s.value)
    return per_token, weights


def speculation_counts(samples: list) -> dict[str, int]:
    """The server's speculative counters (``loadmaster_speculative_*_total``) by their short names."""
    out = {"draft_tokens": 0, "accepted_tokens": 0, "verify_passes": 0}
    for s in samples:
        short = s.name.removeprefix("loadmaster_speculative_").removesuffix("_total")
        if s.name.startswith("loadmaster_speculative_") and s.name.endswith("_total") and short in out:
            out[short] = int(s.value)
    return out


def metric_samples(url: str) -> list:
    """Every sample of one ``GET /metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=60).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def spawn_loadmaster(model: Path, port: int, box: MemoryBox, log: Path, flags: list[str]) -> subprocess.Popen:
    """``loadmaster serve MODEL --port P``, no other flag but ``flags`` (``--speculate MODE``), inside ``box``."""
    cmd = [sys.executable, "-m", "service.cli", "serve", str(model), "--port", str(port), *flags]
    with log.open("w") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=box_env(), cwd=ROOT, preexec_fn=box.join()
        )


def measure_loadmaster(url: str, run: Run, args: argparse.Namespace) -> None:
    """One stream, the plan's prediction and the storage figures, then the concurrent clients."""
    import httpx

    run.tokens, stamps = stream_one(url, args.new_tokens)
    run.one_stream_tok_s = decode_rate(stamps)
    samples = metric_samples(url)  # one read for the stream's counters and storage figures
    for name, value in speculation_counts(samples).items():
        setattr(run, name, value)
    info = httpx.get(url + "/info", timeout=60).json()
    run.predicted_tok_s = predicted_rate(info)
    run.batch_slots = (info.get("limits") or {}).get("max_batch_size")
    run.storage_bytes_per_token, run.weights_bytes = storage_metrics(samples)
    run.predicted_clients_tok_s = predicted_concurrent_rate(info, args.clients)
    if args.clients > 0:
        rates = clients_rate(url, args.clients, args.new_tokens)
        run.clients_tok_s, run.clients_decode_tok_s = rates.tokens_per_s, rates.decode_tokens_per_s
        run.storage_bytes_per_token_clients, _ = storage_metrics(metric_samples(url))


def run_loadmaster(model: Path, limit: int, args: argparse.Namespace, logs: Path, speculate: str = "") -> Run:
    """A cold cache, a fresh box, the server in it (``--speculate speculate`` where given); measured, stopped."""
    from bench.common import wait_ready

    flags = ["--speculate", speculate] if speculate else []
    run = Run(contender_name(speculate), limit)
    with boxed(limit) as box:
        run.cache_drop = cold_cache(model)
        port = free_port()
        t0 = time.perf_counter()
        proc = spawn_loadmaster(model, port, box, logs / f"loadmaster{speculate}-{limit}-{port}.log", flags)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, timeout=args.ready_timeout)
            run.ready_s = time.perf_counter() - t0
            measure_loadmaster(url, run, args)
        except Exception as e:  # an OOM kill, a refusal, a failed request: recorded, the other runs go on
            run.error = f"{type(e).__name__}: {e}"
        finally:
            stop(proc)
            run.oom_kills, run.peak = box.oom_kills(), box.peak()
    return run


def contender_name(speculate: str) -> str:
    return f"loadmaster --speculate {speculate}" if speculate else "loadmaster"


# -- peers (each a fresh process in the box) -----------------------------------------------------------------------
def run_peer(name: str, spec: dict[str, Any], model: Path, limit: int) -> Run:
    """``python -m bench.bigbox --worker SPEC`` in a fresh box after a cold cache; its result as a :class:`Run`."""
    run = Run(name, limit)
    cmd = [sys.executable, "-m", "bench.bigbox", "--worker", json.dumps({**spec, "peer": name})]
    with boxed(limit) as box:
        run.cache_drop = cold_cache(model)
        t0 = time.time()
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env=box_env(),
                cwd=ROOT,
                preexec_fn=box.join(),
                timeout=spec["timeout"],
            )
            apply_worker_result(run, proc, t0)
        except subprocess.TimeoutExpired:
            run.error = f"timed out after {spec['timeout']:.0f} s"
        run.oom_kills, run.peak = box.oom_kills(), box.peak()
    if run.oom_kills and run.one_stream_tok_s is None:
        run.error = f"OOM-killed ({run.error})"
    return run


def apply_worker_result(run: Run, proc: subprocess.CompletedProcess, t0: float) -> None:
    """Copy a peer worker's printed result into ``run``; its exit status and stderr's tail where it printed none."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            out = json.loads(line[len(RESULT_PREFIX) :])
            run.ready_s = out["loaded_at"] - t0
            run.one_stream_tok_s = decode_rate(out["stamps"])
            run.tokens = out["tokens"]
            return
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    run.error = f"exit {proc.returncode}: {tail[-300:]}"


def accelerate_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In the box: accelerate's ``device_map="auto"`` with an offload folder, then one greedy stream, timed."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.common import TokenClock

    with tempfile.TemporaryDirectory(prefix="bigbox-offload-") as offload:
        model = AutoModelForCausalLM.from_pretrained(
            spec["model"], device_map="auto", offload_folder=offload, dtype=torch.float32
        ).eval()
        loaded_at = time.time()
        ids = torch.tensor([spec["prompt_ids"]])
        clock = TokenClock()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=spec["new_tokens"], do_sample=False, streamer=clock)
    return {"loaded_at": loaded_at, "stamps": clock.times, "tokens": out[0, ids.shape[1] :].tolist()}


def llamacpp_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In the box: llama.cpp maps the GGUF (its default ``use_mmap``), then one greedy stream of the prompt ids."""
    from bench.peers.llamacpp import generate, loaded

    prompt = spec["prompt_ids"]
    new = int(spec["new_tokens"])
    threads = len(os.sched_getaffinity(0))
    with loaded(Path(spec["gguf"]), threads, 1, len(prompt) + new + 8, max(len(prompt), 32)) as llm:
        loaded_at = time.time()
        out, times = generate(llm, [prompt], new)
    return {"loaded_at": loaded_at, "stamps": times, "tokens": out[0]}


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "accelerate": accelerate_worker,
    "llamacpp": llamacpp_worker,
}


def peer_spec(name: str, model: Path, prompt_ids: list[int], new_tokens: int, timeout: float) -> dict[str, Any]:
    """What a peer's worker needs; for llama.cpp the binding is installed and the GGUF written here, outside the box."""
    spec: dict[str, Any] = {
        "model": str(model),
        "prompt_ids": prompt_ids,
        "new_tokens": new_tokens,
        "timeout": timeout,
    }
    if name == "llamacpp":
        from bench.common import model_cache_dir
        from bench.peers.llamacpp import ensure_installed, gguf_file

        ensure_installed()
        spec["gguf"] = str(gguf_file(model, model_cache_dir(), "f32"))
    return spec


# -- the reference and the table -----------------------------------------------------------------------------------
def prompt_ids(model: Path) -> list[int]:
    """:data:`PROMPT` as the checkpoint's tokenizer encodes it (what the server sees)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]


def reference_tokens(model: Path, ids: list[int], new_tokens: int) -> list[int]:
    """Plain transformers, greedy, on the same weights, in this process (outside any box); an MXFP4 checkpoint
    through transformers' own dequantizing load (its MXFP4 kernels need a GPU)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quant = json.loads((model / "config.json").read_text()).get("quantization_config") or {}
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quant.get("quant_method") == "mxfp4" else {}
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **extra).eval()
    with torch.inference_mode():
        out = lm.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def agreement(tokens: list[int], reference: list[int]) -> str:
    """ "yes (k/n)" when every token equals the reference's, else "no (k/n)": k the equal tokens from the first."""
    if not tokens:
        return "-"
    k = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    same = k == len(reference) == len(tokens)
    return f"{'yes' if same else 'no'} ({k}/{len(reference)})"


def _best(values: list[float | None], pick: Callable[..., float]) -> float | None:
    present = [v for v in values if v is not None]
    return pick(present) if present else None


def summarize(runs: list[Run], ideal: float | None, reference: list[int]) -> Row:
    """The best of ``runs``: ready min, tokens/s max, OOM kills summed, the largest peak."""
    one = _best([r.one_stream_tok_s for r in runs], max)
    best = max(runs, key=lambda r: r.one_stream_tok_s or 0.0)
    drafted = best.draft_tokens > 0
    predicted = _best([r.predicted_tok_s for r in runs], max)
    busiest = max(runs, key=lambda r: r.clients_decode_tok_s or 0.0)
    measured, foreseen = busiest.clients_decode_tok_s, busiest.predicted_clients_tok_s
    return Row(
        box=format_bytes(runs[0].box),
        contender=runs[0].contender,
        ready_s=_best([r.ready_s for r in runs], min),
        one_stream_tok_s=one,
        clients_tok_s=_best([r.clients_tok_s for r in runs], max),
        clients_decode_tok_s=measured,
        ideal_tok_s=ideal,
        ratio_to_ideal=one / ideal if one and ideal else None,
        predicted_tok_s=predicted,
        prediction_error_pct=100 * (predicted - one) / one if predicted and one else None,
        predicted_clients_tok_s=foreseen,
        clients_prediction_error_pct=100 * (foreseen - measured) / measured if foreseen and measured else None,
        storage_bytes_per_token=best.storage_bytes_per_token,
        acceptance=best.accepted_tokens / best.draft_tokens if drafted else None,
        tokens_per_pass=(best.verify_passes + best.accepted_tokens) / best.verify_passes if drafted else None,
        oom_kills=sum(r.oom_kills for r in runs),
        peak=max(r.peak for r in runs),
        greedy=agreement(best.tokens, reference),
        error=next((r.error for r in runs if r.error), None),
        runs=runs,
    )


def table_rows(rows: list[Row], clients: int) -> list[dict[str, Any]]:
    """The printed table's cells."""

    def n(v: float | None, digits: int = 3) -> str:
        return "-" if v is None else f"{v:.{digits}g}"

    out = []
    for r in rows:
        out.append(
            {
                "box": r.box,
                "contender": r.contender,
                "ready": n(r.ready_s),
                "one": n(r.one_stream_tok_s),
                "clients": n(r.clients_tok_s),
                "clients_decode": n(r.clients_decode_tok_s),
                "clients_predicted": n(r.predicted_clients_tok_s),
                "clients_error": "-"
                if r.clients_prediction_error_pct is None
                else f"{r.clients_prediction_error_pct:+.0f}%",
                "ideal": "resident" if r.ideal_tok_s is None else n(r.ideal_tok_s),
                "ratio": n(r.ratio_to_ideal, 2),
                "predicted": n(r.predicted_tok_s),
                "error_pct": "-" if r.prediction_error_pct is None else f"{r.prediction_error_pct:+.0f}%",
                "bytes_token": "-"
                if r.storage_bytes_per_token is None
                else f"{r.storage_bytes_per_token / 1e6:.0f} MB",
                "acceptance": n(r.acceptance, 2),
                "per_pass": n(r.tokens_per_pass, 3),
                "oom": r.oom_kills,
                "peak": format_bytes(r.peak) if r.peak >= 0 else "-",
                "greedy": r.greedy,
                "note": (r.error or "")[:80],
            }
        )
    return out


def columns(clients: int) -> list[tuple[str, str]]:
    return [
        ("box", "box"),
        ("contender", "contender"),
        ("ready", "ready s"),
        ("one", "1 stream tok/s"),
        ("clients", f"{clients} clients tok/s"),
        ("clients_decode", f"{clients} decoding at once tok/s"),
        ("clients_predicted", f"predicted at {clients}"),
        ("clients_error", f"error at {clients}"),
        ("ideal", "ideal tok/s"),
        ("ratio", "× ideal"),
        ("predicted", "predicted tok/s"),
        ("error_pct", "prediction error"),
        ("bytes_token", "storage bytes/token"),
        ("acceptance", "draft acceptance"),
        ("per_pass", "tokens / verify pass"),
        ("oom", "OOM kills"),
        ("peak", "peak"),
        ("greedy", "greedy = transformers"),
        ("note", "error"),
    ]


def hardware() -> dict[str, Any]:
    """:func:`bench.common.machine` with the CPU's name and the RAM."""
    out = machine()
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    out["cpu"] = next((line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line), None)
    out["memory"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return out


# -- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint folder (default: the 1.03B fp32 Llama); 'margin': bench.margin_model's 1.03B Llama, whose "
        "greedy choice has a stated margin (for --speculate)",
    )
    ap.add_argument("--box", default="3GiB,1.5GiB", help="box sizes, comma-separated (default: 3GiB,1.5GiB)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per contender and box; the best is kept")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients for loadmaster's aggregate rate")
    ap.add_argument("--peers", default="accelerate", help=f"comma list among {','.join(PEERS)} ('' for none)")
    ap.add_argument(
        "--speculate",
        default="",
        help="comma list of --speculate modes (ngram,int4,int8) also served, each a contender beside the no-flag one",
    )
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to be ready")
    ap.add_argument(
        "--peer-timeout", type=float, default=3600.0, help="seconds a peer process may run (a thrashing one crawls)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bigbox.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    args.speculate = [m for m in args.speculate.split(",") if m]
    if set(args.speculate) - {"ngram", "int4", "int8"}:
        ap.error(f"--speculate takes ngram, int4 and int8, not {args.speculate}")
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose among {', '.join(PEERS)}")
    return args


def default_model() -> Path:
    from bench.common import llama_dir

    return llama_dir("1b", "float32")


def margin_model() -> Path:
    from bench.margin_model import margin_llama_dir

    return margin_llama_dir()


def run_box(model: Path, limit: int, args: argparse.Namespace, specs: dict[str, dict], logs: Path) -> list[list[Run]]:
    """Every contender ``--repeat`` times in boxes of ``limit`` bytes, alternating within each round."""
    served = {contender_name(m): m for m in ["", *args.speculate]}
    names = [*served, *args.peers]
    runs: dict[str, list[Run]] = {n: [] for n in names}
    for round_ in range(max(1, args.repeat)):
        for name in names:
            r = (
                run_loadmaster(model, limit, args, logs, served[name])
                if name in served
                else run_peer(name, specs[name], model, limit)
            )
            runs[name].append(r)
            brief = {k: getattr(r, k) for k in ("ready_s", "one_stream_tok_s", "clients_tok_s", "oom_kills", "error")}
            print(f"{format_bytes(limit)} round {round_} {name}: {json.dumps(brief)}", flush=True)
    return list(runs.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        emit(WORKERS[spec["peer"]](spec))
        return 0
    why_not = cgroup_unavailable()
    if why_not:
        print(f"bench.bigbox: {why_not}", file=sys.stderr)
        return 2
    model = default_model() if args.model is None else margin_model() if args.model == "margin" else Path(args.model)
    model = model.resolve()
    limits = [parse_size(b) for b in args.box.split(",")]
    checkpoint = sum(f.stat().st_size for f in shards(model))
    disk = disk_rate(model, args.repeat)
    streamed = streamed_rate(model, args.repeat)
    print(
        f"{model.name}: {format_bytes(checkpoint)} of weights; disk {disk.bytes_per_s / 1e9:.2f} GB/s ({disk.method}), "
        f"{streamed.bytes_per_s / 1e9:.2f} GB/s streamed ({streamed.method})"
    )
    ids = prompt_ids(model)
    specs = {p: peer_spec(p, model, ids, args.new_tokens, args.peer_timeout) for p in args.peers}
    logs = Path(tempfile.mkdtemp(prefix="bigbox-logs-"))
    all_runs = {limit: run_box(model, limit, args, specs, logs) for limit in limits}
    reference = reference_tokens(model, ids, args.new_tokens)
    rows = [
        summarize(runs, ideal_tok_s(disk.bytes_per_s, checkpoint, limit), reference)
        for limit, per_contender in all_runs.items()
        for runs in per_contender
    ]
    text = print_table(table_rows(rows, args.clients), columns(args.clients))
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": str(model),
        "checkpoint_bytes": checkpoint,
        "disk": asdict(disk),
        "disk_streamed": asdict(streamed),
        "prompt": PROMPT,
        "new_tokens": args.new_tokens,
        "clients": args.clients,
        "repeat": args.repeat,
        "reference_tokens": reference,
        "hardware": hardware(),
        "server_logs": str(logs),
        "rows": [asdict(r) for r in rows],
        "table": text,
    }
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
