"""The GPU check's serving stage (:mod:`bench.gpu_stages`): ``loadmaster serve`` and ``transformers serve
--continuous-batching`` on the same weights and device, ``clients`` concurrent /v1/completions each (half greedy,
half seeded samples). Every wait is bounded by the stage's own time left, never by a fixed 600 s."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

Report = Callable[..., None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(cmd: list[str], url: str, log_path: Path, ready: str, deadline: float, dry: bool) -> subprocess.Popen:
    """Start a server in its own process group and wait until ``ready`` answers 200 or ``deadline`` passes."""
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if dry:  # the CPU only, whatever nvidia-smi (a stand-in in the harness test) says
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-400:]
            raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(url + ready, timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    _stop(proc)
    raise RuntimeError(f"{' '.join(cmd[:4])} not ready in time; see {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _completions(url: str, clients: int, max_tokens: int, deadline: float) -> tuple[list[dict], float]:
    """``clients`` concurrent completions, even ones greedy, odd ones sampled; (answers with latency, seconds)."""
    import httpx

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    answers: list[dict] = [{} for _ in range(clients)]

    def one(i: int) -> None:
        body = {
            "model": model,
            "prompt": f"Request {i}: the river stone and the winter light",
            "max_tokens": max_tokens,
        }
        body.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": i})
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=max(5.0, deadline - time.monotonic()))
            answers[i] = r.json() if r.status_code == 200 else {"error": f"{r.status_code}: {r.text[:200]}"}
        except httpx.HTTPError as exc:
            answers[i] = {"error": f"{type(exc).__name__}: {exc}"}
        answers[i]["latency_s"] = time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, time.perf_counter() - t0


def _command(name: str, path: Path, port: int, dtype: str, device: str, clients: int, extra: list[str]) -> list[str]:
    if name.startswith("loadmaster"):
        cmd = [sys.executable, "-m", "service.cli", "serve", str(path), "--port", str(port), "--dtype", dtype]
        return cmd + ["--max-batch-size", str(clients), "--log-level", "warning", *extra]
    cli = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())"]
    return [
        *cli,
        "serve",
        str(path),
        "--continuous-batching",
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
    ]


def one_server(ctx: dict, report: Report, name: str, dtype: str, extra: list[str] = ()) -> list[dict] | None:
    """Start ``name``, send the clients, report one line; the answers (None when it did not serve)."""
    path = Path(ctx["model_dir"])
    port, deadline = _free_port(), ctx["deadline"] - 5
    url = f"http://127.0.0.1:{port}"
    device = "cpu" if ctx["dry"] else "cuda:0"
    cmd = _command(name, path, port, dtype, device, ctx["clients"], list(extra))  # [python, -m|-c, ...]
    t0 = time.perf_counter()
    try:
        proc = _serve(
            cmd,
            url,
            Path(ctx["out"]) / f"serve-{name.replace(' ', '_')}.log",
            "/health/ready" if name.startswith("loadmaster") else "/health",
            deadline,
            ctx["dry"],
        )
    except Exception as exc:  # noqa: BLE001 - one server failing must not lose the others' lines
        report(f"serve ({name}, {dtype})", "FAIL", f"did not start: {str(exc)[-300:]}")
        return None
    ready = time.perf_counter() - t0
    try:
        answers, seconds = _completions(url, ctx["clients"], ctx["serve_tokens"], deadline)
    finally:
        _stop(proc)
    errors = [a["error"] for a in answers if "error" in a]
    tokens = sum(a.get("usage", {}).get("completion_tokens", 0) for a in answers if "error" not in a)
    lat = sorted(a["latency_s"] for a in answers)
    p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
    detail = (
        f"{len(answers) - len(errors)}/{len(answers)} answered, {tokens / seconds:.1f} tok/s, ready in "
        f"{ready:.1f} s, request latency p50 {statistics.median(lat):.2f} s p95 {p95:.2f} s"
    )
    report(
        f"serve ({name}, {dtype})",
        "FAIL" if errors else "PASS",
        detail + (f"; {errors[:1]}" if errors else ""),
        tok_s=tokens / seconds,
        ready_s=ready,
    )
    return answers


def serving_runs(ctx: dict, report: Report, path: Path) -> None:
    """fp32 texts of both servers (greedy ones must agree), then bf16 speed of both, then loadmaster offloaded."""
    ctx = dict(ctx, model_dir=str(path))
    texts = {}
    for name in ("loadmaster", "transformers"):
        answers = one_server(ctx, report, name, "float32")
        if answers is not None:
            texts[name] = [a.get("choices", [{}])[0].get("text") for a in answers[::2]]
    if len(texts) == 2:
        same = sum(a == b and a is not None for a, b in zip(texts["loadmaster"], texts["transformers"]))
        n = len(texts["loadmaster"])
        report("serve: fp32 greedy texts equal transformers serve's", "PASS" if same == n else "FAIL", f"{same}/{n}")
    if ctx["dry"]:
        report("serve: bf16 speed and offloaded run", "SKIP", "speed is measured on the GPU only")
        return
    for name in ("loadmaster", "transformers"):
        one_server(ctx, report, name, "bfloat16")
    half = sum(p.stat().st_size for p in path.glob("*.safetensors")) // 2 // 2**20
    one_server(ctx, report, "loadmaster offloaded", "bfloat16", ["--max-memory", f"0={half}MiB"])
