"""Shared pieces of the loader benchmarks: isolated runs, page-cache control, decode timing, tables and JSON.

Each contender runs in a fresh Python process (``run_isolated``) so that its peak RSS is its own and nothing it
imported or cached helps the next one. The child prints one JSON line; the parent collects them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH_RESULT "


# -- processes ---------------------------------------------------------------------------------------------------
def model_cache_dir() -> Path:
    """Where benchmark models are built: the tests' cache folder, so a model built by either is built once."""
    return Path(os.environ.get("LOADMASTER_TEST_CACHE") or ROOT / ".cache" / "test-models")


def llama_dir(size: str, dtype: str) -> Path:
    """A random-weight Llama benchmark model (``size`` "100m" or "1b"), built once into :func:`model_cache_dir`."""
    from service.model.random_models import build_model

    return build_model("llama", model_cache_dir() / f"llama-{size}-{dtype}", size=size, dtype=dtype)


def run_isolated(module: str, spec: dict, timeout: float = 1800) -> dict:
    """Run ``python -m module --worker SPEC`` in a fresh interpreter and return the dict its worker printed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", module, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
    return {"error": f"worker exited with {proc.returncode}: {tail}"}


def best_of(module: str, spec: dict, repeats: int) -> dict:
    """Run a contender ``repeats`` times (fresh process each); each timing is the best over the runs.

    The machine is shared: a neighbour's burst can stall torch's two threads and halve any single measurement,
    so times to ready and first token are the minimum over runs and decode rates the maximum (each run's values
    are kept in ``*_runs``). Sizes (RSS, bytes written) come from the run that got ready fastest.
    """
    runs = [run_isolated(module, spec) for _ in range(max(1, repeats))]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    best = dict(min(ok, key=lambda r: r["ready_s"]))
    for key, pick in (
        ("ready_s", min),
        ("first_token_s", min),
        ("prefill_s", min),
        ("decode_tok_s", max),
        ("decode_tok_s_mean", max),
    ):
        if all(key in r for r in ok):
            best[f"{key}_runs"] = [r[key] for r in ok]
            best[key] = pick(r[key] for r in ok)
    if "decode_tok_s" in best and "bytes_per_token" in best:
        best["decode_gb_s"] = best["bytes_per_token"] * best["decode_tok_s"] / 1e9
    return best


def emit(result: dict) -> None:
    """Called by a worker: hand its result to the parent."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# -- page cache --------------------------------------------------------------------------------------------------
def run_together(threads: Sequence[threading.Thread]) -> float:
    """Start every thread, wait for all of them: the wall seconds from the first start to the last end (how the
    benches time clients sent at once)."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def drop_cache(paths: Iterable[Path]) -> int:
    """Evict the files' pages from the page cache (``POSIX_FADV_DONTNEED``). Mapped, touched pages stay."""
    n = 0
    for p in paths:
        p = Path(p)
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else []
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd) if os.access(f, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def disk_read_bandwidth(path: Path, limit: int = 1 << 30, repeats: int = 3) -> float:
    """Cold sequential read rate of one file (bytes/s), best of ``repeats``: the ceiling for a cold-cache decode."""
    return max(_cold_read(path, limit) for _ in range(repeats))


def _cold_read(path: Path, limit: int) -> float:
    drop_cache([path])
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    done = 0
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while done < limit:
            n = f.readinto(view)
            if not n:
                break
            done += n
    dt = time.perf_counter() - t
    drop_cache([path])
    return done / dt if dt > 0 else 0.0


# -- decode timing -----------------------------------------------------------------------------------------------
class TokenClock:
    """A transformers streamer that timestamps every generated token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_generation(model, prompt_len: int = 16, new_tokens: int = 16, vocab: int = 1000) -> dict:
    """Greedy generation from a fixed prompt: first-token latency and steady decode tokens/s."""
    import torch

    ids = torch.arange(1, prompt_len + 1).unsqueeze(0) % vocab
    clock = TokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0
        )
    return _generation_timing(t0, clock.times, out[0, prompt_len:].tolist())


def median_gap(times: Sequence[float]) -> float:
    """The median gap between consecutive clock readings (0.0 for fewer than two). The median, not the mean: on a
    shared 2-core machine a neighbour's burst stalls a whole step (torch's threads wait for the slowest), and one
    such stall would otherwise dominate a short run."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else 0.0


def median_rate(times: Sequence[float]) -> float:
    """Steps per second from :func:`median_gap` (0.0 when there is no gap)."""
    median = median_gap(times)
    return 1.0 / median if median > 0 else 0.0


def _generation_timing(t0: float, times: list[float], tokens: list[int]) -> dict:
    """First-token latency and decode rates from the start time and each token's timestamp."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "first_token_s": times[0] - t0,
        "decode_tok_s": median_rate(times),
        "decode_tok_s_mean": len(gaps) / sum(gaps) if gaps and sum(gaps) > 0 else 0.0,
        "tokens": tokens,
    }


def time_engine_generation(
    model, prompt_len: int = 16, new_tokens: int = 16, vocab: int = 1000, clock=time.perf_counter
) -> dict:
    """As :func:`time_generation`, through the engine's model runner (:class:`service.engine.model_runner.ModelRunner` over
    a :class:`service.engine.kv_pool.SlotKVCache`): what ``loadmaster serve`` runs for one sequence at each step, the
    native decode step included where the model takes it (:mod:`loaders.native.decode_step`), without HTTP or sampling
    (greedy argmax). ``clock``: ``time.process_time`` gives tokens per CPU-second instead."""
    import torch

    from service.engine.kv_pool import SlotKVCache
    from service.engine.model_runner import ModelRunner, Row

    ids = [i % vocab for i in range(1, prompt_len + 1)]
    runner = ModelRunner(model, torch.device("cpu"), SlotKVCache(1, prompt_len + new_tokens))
    tokens: list[int] = []
    times: list[float] = []
    t0 = clock()
    row = Row(0, 0, ids)
    for _ in range(new_tokens):
        token = int(runner.run([row]).last[0].argmax())
        times.append(clock())
        tokens.append(token)
        row = Row(0, prompt_len + len(tokens) - 1, [token])
    return _generation_timing(t0, times, tokens)


def token_agreement(rows: list[dict], reference: str) -> None:
    """Set each row's ``tokens_vs_transformers`` to "k/n": how many of its greedy tokens, from the first, equal
    those of the first row whose label starts with ``reference`` (the peer's own result on the same weights).

    In bf16 two correct kernels that sum in different orders may round a near-tie logit apart, after which the
    greedy paths diverge; the count shows how long they agree. In fp32 the paths must agree in full.
    """
    ref = next((r for r in rows if r.get("label", "").startswith(reference) and "tokens" in r), None)
    if ref is None:
        return
    for r in rows:
        if "tokens" not in r:
            continue
        k = 0
        for a, b in zip(r["tokens"], ref["tokens"]):
            if a != b:
                break
            k += 1
        r["tokens_vs_transformers"] = f"{k}/{len(ref['tokens'])}"


def decode_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every tensor except embedding tables (one row each)."""
    import torch

    total = 0
    seen = set()
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    head_id = id(head.weight) if head is not None else None
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in emb_ids and id(p) != head_id:
            total += p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    if head_id is not None and head_id in emb_ids:
        total += 0  # tied head: counted once, in full, as the head
    return total


# -- output ------------------------------------------------------------------------------------------------------
def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and abs(v) >= 1 << 20:
        return f"{v / (1 << 30):.2f} GiB"
    return str(v)


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """Render rows as a Markdown table (also readable in a terminal); returns the text it printed."""
    head = [title for _, title in columns]
    body = [[fmt(r.get(key)) for key, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in body]
    text = "\n".join(lines)
    print(text)
    return text


def write_json(path: Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)
    print(f"wrote {path}")


def machine() -> dict:
    import platform

    import torch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
    }


def spawn_server(
    model_dir: Path, port: int, log_path: Path, threads: int | None, flags: Sequence[str]
) -> subprocess.Popen:
    """Start a benchmark's ``loadmaster serve`` of ``model_dir`` on ``port`` (offline, warnings only, torch on
    ``threads``), with the benchmark's own ``flags``; its output goes to ``log_path``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    cmd += [*flags, *(["--threads", str(threads)] if threads else [])]
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Wait until a benchmark's ``loadmaster serve`` answers ``/health/ready`` with 200; fail early when it exits or
    reports a failed load."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/health/ready", timeout=5)
            if r.status_code == 200:
                return
            if r.json().get("status") == "failed":
                raise RuntimeError(f"server failed to load: {r.json().get('error')}")
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not ready in time")
