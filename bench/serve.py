"""Serving benchmark: aggregate tokens/s and latency at 1, 4 and 16 concurrent clients against a real
``loadmaster serve`` process, next to the baseline of calling transformers' ``generate`` once per request in turn.

    .venv/bin/python -m bench.serve                       # ~100M-parameter Llama fixture, fp32
    .venv/bin/python -m bench.serve --clients 1,4,16 --requests 32 --max-new-tokens 64 --out bench/results/serve.json
    .venv/bin/python -m bench.serve --dtype bfloat16 --out bench/results/serve-bf16.json   # bf16 weights and compute
    .venv/bin/python -m bench.serve --clients 1,16 --requests 16 --repeats 3 --peers   # issue 9's side-by-side

With ``--peers`` the same prompts also go, in fresh processes, to transformers' batched ``generate`` (all prompts in
one left-padded call), its continuous batching (``generate_batch``, what ``transformers serve
--continuous-batching`` runs) and a lone ``generate`` (:mod:`bench.peers.transformers_cb`), and the table gives
each server level's ratio to them; llama.cpp gets the same prompts as token ids on the same weights written as GGUF,
batched by its C API (:mod:`bench.peers.llamacpp`, installed on first use). ``--repeats`` keeps the best of that
many runs of every contender.

After the throughput levels the same server measures latency (:mod:`bench.serve_latency`): time to first token
with and without the prefix cache, and the inter-token latency of running streams while a ~4k-token prompt is
prefilled (``--skip-latency`` leaves it out).

Each request is greedy with a fixed ``max_new_tokens`` on a distinct prompt; tokens/s counts generated tokens
actually returned. Latency is a whole request (HTTP round trip included for the server). The baseline runs in
this process on the same weights and dtype, one request after another, as a user without a server would.
Targets (issue 4): at 16 clients >= 4x the baseline's aggregate tokens/s; a lone request <= 10% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import run_together, spawn_server, wait_ready

ROOT = Path(__file__).resolve().parent.parent

WORDS = (
    "river stone light garden winter market letter window harbor forest engine silver morning story "
    "village mountain paper station lantern bridge"
).split()


def prompts(n: int) -> list[str]:
    """Distinct prompts of varied length (8 to 40 words), reproducible."""
    out = []
    for i in range(n):
        k = 8 + (i * 7) % 33
        out.append(" ".join(WORDS[(i + j * 3) % len(WORDS)] for j in range(k)))
    return out


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    idx = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[idx]


def summarize(latencies: list[float], tokens: int, wall: float) -> dict[str, float]:
    return {
        "requests": len(latencies),
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "latency_p50_s": round(percentile(latencies, 50), 4),
        "latency_p99_s": round(percentile(latencies, 99), 4),
    }


# -- baseline ------------------------------------------------------------------------------------------------------
def run_baseline(
    model_dir: Path, texts: list[str], max_new_tokens: int, threads: int | None, dtype: str = "float32"
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = model.generation_config.eos_token_id
    lat, total = [], 0
    with torch.inference_mode():
        ids = tok(texts[0], return_tensors="pt")
        model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)  # warm-up
        t0 = time.perf_counter()
        for text in texts:
            ids = tok(text, return_tensors="pt")
            s = time.perf_counter()
            out = model.generate(
                **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=eos
            )
            lat.append(time.perf_counter() - s)
            total += out.shape[1] - ids["input_ids"].shape[1]
        wall = time.perf_counter() - t0
    del model
    return summarize(lat, total, wall)


# -- server --------------------------------------------------------------------------------------------------------
def start_server(
    model_dir: Path,
    port: int,
    max_batch: int,
    log_path: Path,
    threads: int | None,
    dtype: str = "float32",
    offload_half: bool = False,
    max_total_tokens: int = 1024,
    prefix_cache: bool = True,
) -> subprocess.Popen:
    """The benchmark's server. The throughput levels run it with ``prefix_cache=False``: their rounds send the same
    prompts again, which the prefix cache would serve from its slots, and the peers keep nothing between calls."""
    flags = ["--max-batch-size", str(max_batch), "--max-concurrent-requests", "256", "--dtype", dtype]
    flags += [] if prefix_cache else ["--no-prefix-cache"]
    flags += ["--max-total-tokens", str(max_total_tokens), "--max-input-tokens", str(max_total_tokens - 128)]
    if offload_half:
        from bench.offload import half_on_disk_map

        device_map, _ = half_on_disk_map(model_dir)
        flags += ["--strategy", json.dumps(device_map), "--offload-folder", str(log_path.parent / "offload")]
    return spawn_server(model_dir, port, log_path, threads, flags)


def run_clients(url: str, texts: list[str], clients: int, max_new_tokens: int) -> dict[str, Any]:
    """``clients`` threads, each sending its share of ``texts`` one request at a time."""
    import httpx

    lat: list[float] = []
    tokens = [0]
    errors: list[str] = []
    lock = threading.Lock()
    todo = list(enumerate(texts))

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    _, text = todo.pop(0)
                s = time.perf_counter()
                r = c.post(
                    "/generate",
                    json={"inputs": text, "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
                )
                dt = time.perf_counter() - s
                with lock:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {r.text[:200]}")
                        continue
                    lat.append(dt)
                    tokens[0] += r.json()["details"]["generated_tokens"]

    wall = run_together([threading.Thread(target=worker) for _ in range(clients)])
    out = summarize(lat, tokens[0], wall)
    out["clients"] = clients
    out["errors"] = errors
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the random-weight Llama of --size)")
    p.add_argument("--size", default="100m", choices=["100m", "1b"], help="benchmark Llama when --model is unset")
    p.add_argument("--repeats", type=int, default=1, help="runs of each contender; the best is kept")
    p.add_argument(
        "--peers", action="store_true", help="also run transformers' batched generate and CB, and llama.cpp batched"
    )
    p.add_argument("--offload-half", action="store_true", help="serve with half the decoder layers on disk")
    p.add_argument("--skip-baseline", action="store_true", help="skip the one-request-at-a-time generate baseline")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (and for the baseline)")
    p.add_argument(
        "--lone-requests",
        type=int,
        default=None,
        help="requests at the 1-client level (default: --requests); they run one after another, so fewer saves time",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and compute for both contenders (bfloat16: the server's native CPU kernel)",
    )
    p.add_argument("--skip-latency", action="store_true", help="skip the prefix-cache TTFT and long-prompt ITL runs")
    p.add_argument("--long-tokens", type=int, default=4000, help="length of the long prompt of the ITL run")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for both contenders (1 avoids OpenMP stalls on a busy shared CPU)",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve.json"))
    args = p.parse_args(argv)

    if args.model:
        model_dir = Path(args.model)
    else:
        from bench.common import llama_dir

        model_dir = llama_dir(args.size, args.dtype)
    levels = [int(x) for x in args.clients.split(",")]
    texts = prompts(args.requests)

    print(
        f"model: {model_dir}  requests/level: {args.requests}  max_new_tokens: {args.max_new_tokens}  "
        f"threads: {args.threads or 'default'}",
        flush=True,
    )
    print("baseline: transformers generate, one request at a time ...", flush=True)
    if args.skip_baseline:
        baseline = {"tokens_per_s": 0.0, "latency_p50_s": float("nan"), "latency_p99_s": float("nan")}
    else:
        baseline = run_baseline(model_dir, texts, args.max_new_tokens, args.threads, args.dtype)
    peers: dict[str, Any] = {}
    if args.peers:
        from bench.common import run_isolated

        print("peers: transformers batched generate, continuous batching, lone generate ...", flush=True)
        peers = run_isolated(
            "bench.peers.transformers_cb",
            {
                "model": str(model_dir),
                "dtype": args.dtype,
                "texts": texts[: max(levels)],
                "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats,
                "threads": args.threads,
            },
            timeout=7200,
        )
        print(f"peers: {peers}", flush=True)
        print("peers: llama.cpp batched (the same prompts as token ids, one llama_batch per step) ...", flush=True)
        from bench.common import model_cache_dir

        peers.update(  # the worker installs llama.cpp first if it is missing
            run_isolated(
                "bench.peers.llamacpp",
                {
                    "model": str(model_dir),
                    "cache": str(model_cache_dir()),
                    "dtype": args.dtype,
                    "texts": texts[: max(levels)],
                    "max_new_tokens": args.max_new_tokens,
                    "repeats": args.repeats,
                    "threads": args.threads or 2,
                },
                timeout=3600,
            )
        )
        print(f"peers: {peers}", flush=True)

    port = args.port
    if not port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_path.with_suffix(".server.log")
    limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or 4096
    long_tokens = min(args.long_tokens, limit - 256)

    def serve(prefix_cache: bool) -> subprocess.Popen:
        return start_server(
            model_dir,
            port,
            args.max_batch_size,
            log_path,
            args.threads,
            args.dtype,
            offload_half=args.offload_half,
            max_total_tokens=min(limit, max(1024, long_tokens + 256)),
            prefix_cache=prefix_cache,
        )

    def stop(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()

    results = []
    latency: dict[str, Any] = {}
    proc = serve(prefix_cache=False)  # every round's prompts are prefilled, as the peers' are
    try:
        wait_ready(url, proc)
        run_clients(url, texts[:2], 1, 4)  # warm-up
        for c in levels:
            print(f"server: {c} concurrent client(s) ...", flush=True)
            level_texts = texts[: args.lone_requests] if c == 1 and args.lone_requests else texts
            runs = [run_clients(url, level_texts, c, args.max_new_tokens) for _ in range(max(1, args.repeats))]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            best["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
            results.append(best)
    finally:
        stop(proc)
    if not args.skip_latency:
        from bench.serve_latency import long_prompt_itl, long_text, prefix_cache_ttft

        proc = serve(prefix_cache=True)
        try:
            wait_ready(url, proc)
            print("server: time to first token, cold and with the prefix cache ...", flush=True)
            latency["prefix_cache"] = prefix_cache_ttft(url)
            print(
                f"server: inter-token latency of 4 streams while a {long_tokens}-token prompt arrives ...", flush=True
            )
            latency["long_prompt"] = long_prompt_itl(url, long_text(str(model_dir), long_tokens))
        finally:
            stop(proc)

    header = f"{'contender':<26} {'clients':>7} {'tokens/s':>9} {'x base':>7} {'p50 s':>8} {'p99 s':>8} {'errors':>6}"
    print()
    print(header)
    print("-" * len(header))
    base_tps = baseline["tokens_per_s"]
    print(
        f"{'transformers generate':<26} {1:>7} {base_tps:>9.1f} {1.0:>7.2f} {baseline['latency_p50_s']:>8.3f} "
        f"{baseline['latency_p99_s']:>8.3f} {0:>6}"
    )
    for r in results:
        ratio = r["tokens_per_s"] / base_tps if base_tps else float("nan")
        r["speedup_vs_baseline"] = round(ratio, 3) if base_tps else None
        print(
            f"{'loadmaster serve':<26} {r['clients']:>7} {r['tokens_per_s']:>9.1f} {ratio:>7.2f} "
            f"{r['latency_p50_s']:>8.3f} {r['latency_p99_s']:>8.3f} {len(r['errors']):>6}"
        )
    for name, key in (
        ("transformers generate (batched)", "generate_batched_tps"),
        ("transformers continuous batching", "continuous_batching_tps"),
        ("transformers CB, lone request", "continuous_batching_lone_tps"),
        ("transformers generate, lone", "generate_lone_tps"),
        ("llama.cpp batched", "llamacpp_batched_tps"),
        ("llama.cpp, lone sequence", "llamacpp_lone_tps"),
    ):
        if key in peers:
            print(f"{name:<34} {peers[key]:>9.1f} tokens/s")
    for r in results:
        tps = r["tokens_per_s"]
        peer = "continuous_batching_tps" if r["clients"] > 1 else "continuous_batching_lone_tps"
        ratios = {}
        many = r["clients"] > 1
        for key in (
            peer,
            "generate_batched_tps" if many else "generate_lone_tps",
            "llamacpp_batched_tps" if many else "llamacpp_lone_tps",
        ):
            if peers.get(key):
                ratios[key] = round(tps / peers[key], 3)
        r["vs_peers"] = ratios
        if ratios:
            print(f"loadmaster serve, {r['clients']} client(s): {tps:.1f} tokens/s; ratios {ratios}")
    if latency:
        pc, lp = latency["prefix_cache"], latency["long_prompt"]
        print(
            f"\ntime to first token (~300-token system prompt): cold {pc['ttft_cold_p50_s']:.3f} s, with the prefix "
            f"cache {pc['ttft_warm_p50_s']:.3f} s ({pc['ttft_speedup']:.2f}x)"
        )
        print(
            f"inter-token latency of {lp['streams']} streams: p50 {lp['itl_before_p50_s']} s before, while a "
            f"{long_tokens}-token prompt is prefilled p50 {lp['itl_during_p50_s']} s, max {lp['itl_during_max_s']} s "
            f"(its first token after {lp['long_prompt_ttft_s']} s)"
        )
    lone = next((r for r in results if r["clients"] == 1), None)
    top = next((r for r in results if r["clients"] == 16), None)
    verdict: dict[str, Any] = {}
    if lone and not args.skip_baseline:
        slower = lone["latency_p50_s"] / baseline["latency_p50_s"] - 1
        verdict["lone_request_slower_than_generate"] = round(slower, 4)
        verdict["lone_target_met"] = slower <= 0.10
        print(f"\nlone request vs bare generate (p50): {slower:+.1%}  (target <= +10%)")
    if top and base_tps:
        verdict["speedup_at_16"] = top["speedup_vs_baseline"]
        verdict["speedup_target_met"] = top["speedup_vs_baseline"] >= 4.0
        print(f"aggregate tokens/s at 16 clients: {top['speedup_vs_baseline']:.2f}x baseline  (target >= 4x)")
    import platform

    import torch

    record = {
        "benchmark": "serve",
        "model": str(model_dir),
        "requests_per_level": args.requests,
        "lone_requests": args.lone_requests or args.requests,
        "max_new_tokens": args.max_new_tokens,
        "max_batch_size": args.max_batch_size,
        "threads": args.threads,
        "dtype": args.dtype,
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
            "platform": platform.platform(),
        },
        "baseline": baseline,
        "peers": peers,
        "offload_half": args.offload_half,
        "throughput_prefix_cache": False,  # the levels ran with --no-prefix-cache
        "server": results,
        "latency": latency,
        "verdict": verdict,
    }
    out_path.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
