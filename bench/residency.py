"""Decode of CPU-resident weights under memory pressure, locked (``cpu_residency="lock"``) against evictable maps.

    .venv/bin/python -m bench.residency                       # 100M fp32 Llama, both modes, best of 3
    .venv/bin/python -m bench.residency --size 1b --dtype bfloat16 --tokens 16

For each mode a fresh process loads the model fully on the CPU and times greedy decode (tokens/s, best of
``--repeats``); then a memory hog (a child process that allocates and touches all of ``MemAvailable`` but
``--margin``, with ``oom_score_adj`` 1000 so that the kernel kills it first) squeezes the page cache, and decode is
timed again while it holds. The ratio pressured / unpressured is the figure; the issue's target is >= 0.8.
Run it only where a short spell of memory pressure harms no one else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import RESULT_PREFIX, emit, llama_dir, run_isolated

HOG_CHUNK = 64 << 20


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _hog(nbytes: int) -> None:
    """Child: allocate and touch ``nbytes``, say so on stdout, then hold until killed."""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    held = []
    for _ in range(nbytes // HOG_CHUNK):
        b = bytearray(HOG_CHUNK)
        b[::4096] = b"\x01" * len(b[::4096])
        held.append(b)
    print("held", flush=True)
    time.sleep(3600)


def _decode_rate(model, tokens: int, repeats: int) -> float:
    import torch

    ids = torch.tensor([[1, 2, 3, 4]])
    best = 0.0
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            best = max(best, tokens / (time.perf_counter() - t0))
    return best


def _worker(spec: dict) -> dict:
    import torch

    import loaders

    torch.set_num_threads(spec["threads"])
    model = loaders.load_model(spec["path"], device_map={"": "cpu"}, show_progress=False, cpu_residency=spec["mode"])
    calm = _decode_rate(model, spec["tokens"], spec["repeats"])
    hog_bytes = max(0, _mem_available() - spec["margin"])
    hog = subprocess.Popen(
        [sys.executable, "-m", "bench.residency", "--hog", str(hog_bytes)], stdout=subprocess.PIPE, text=True
    )
    try:
        hog.stdout.readline()  # "held", or EOF when the kernel killed it
        pressured = _decode_rate(model, spec["tokens"], spec["repeats"])
        available = _mem_available()
    finally:
        hog.kill()
        hog.wait()
    res = model.load_stats.residency
    return {
        "mode": spec["mode"],
        "calm_tok_s": calm,
        "pressured_tok_s": pressured,
        "ratio": pressured / calm if calm else None,
        "hog_bytes": hog_bytes,
        "available_under_pressure": available,
        "locked_bytes": getattr(res, "locked_bytes", 0),
        "lock_seconds": getattr(res, "seconds", 0.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=("100m", "1b"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--margin", type=int, default=2 << 30, help="bytes of MemAvailable the hog leaves (default 2 GiB)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hog", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hog is not None:
        _hog(args.hog)
        return 0
    if args.worker is not None:
        emit(_worker(json.loads(args.worker)))
        return 0
    path = str(llama_dir(args.size, args.dtype))
    rows = []
    for mode in ("map", "lock"):
        spec = dict(
            path=path, mode=mode, tokens=args.tokens, repeats=args.repeats, threads=args.threads, margin=args.margin
        )
        r = run_isolated("bench.residency", spec)
        rows.append(r)
        if "error" in r:
            print(f"{mode}: {r['error']}")
            continue
        print(
            f"{mode}: {r['calm_tok_s']:.2f} tok/s calm, {r['pressured_tok_s']:.2f} under pressure "
            f"(hog {r['hog_bytes'] / 2**30:.1f} GiB): ratio {r['ratio']:.2f}; locked {r['locked_bytes'] / 2**30:.2f} "
            f"GiB in {r['lock_seconds']:.2f}s",
            flush=True,
        )
    print(f"load average {os.getloadavg()[0]:.1f}; target ratio >= 0.8 ({RESULT_PREFIX.strip()} lines hold the rest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
