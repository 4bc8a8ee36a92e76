"""Kernel benchmark: the native CPU kernels on each instruction-set path, side by side, as memory bandwidth.

For each weight format (bf16, fp32, int8, int4, fp8: e4m3 with a float32 scale per 128x128 block, mxfp4: e2m1
blocks of 32 with an e8m0 scale byte each, as checkpoints store them) and each path this CPU runs (``avx512``, ``avx2``, forced the way
``LOADMASTER_CPU_ISA`` forces them) plus torch's own kernels (``F.linear`` on the same weights, dequantized once for
the quantized formats), it times one-row products ``x @ W^T`` over a set of matrices larger than the caches, and
reports the bandwidth reached: bytes of weights (and scales) read per second. Paths alternate within each round
and every figure is the best of the rounds, so a neighbour's burst on this shared machine hits all of them alike.
The headline is AVX2's bandwidth as a share of AVX-512's (target: at least 0.85).

Run from the repository root: ``.venv/bin/python -m bench.kernels [--rows 1] [--rounds 5] [--threads 2] [--out bench/results/kernels.json]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from bench.common import machine, print_table, write_json
from loaders.native import kernel_build, operators, quantization

FORMATS = ("bfloat16", "float32", "int8", "int4", "fp8", "mxfp4")


def _weights(fmt: str, n: int, k: int, count: int, seed: int = 0) -> list[dict]:
    """``count`` random matrices of one format, each as the operands its kernel takes, with its bytes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        w = torch.randn(n, k, generator=g) * 0.02
        if fmt in ("bfloat16", "float32"):
            wt = w.to(getattr(torch, fmt))
            out.append({"w": wt, "bytes": wt.numel() * wt.element_size(), "dense": wt})
        elif fmt == "fp8":
            s = torch.full((-(-n // 128), -(-k // 128)), 0.02 / 448 * 4)
            q = (w / s[0, 0]).to(torch.float8_e4m3fn)
            deq = operators.dequantize_fp8(q, s, 128, 128, torch.bfloat16)
            out.append({"q": q, "s": s, "bytes": q.numel() + s.numel() * 4, "dense": deq})
        elif fmt == "mxfp4":  # random codes, one scale for all (k must be a multiple of 32)
            q = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
            s = torch.full((n, k // 32), 127 - 8, dtype=torch.uint8)
            deq = operators.dequantize_mxfp4(q, s, torch.bfloat16)
            out.append({"q": q, "s": s, "bytes": q.numel() + s.numel(), "dense": deq})
        else:
            q, s = quantization.QUANTIZERS[fmt](w)
            deq = (operators.dequantize_int8 if fmt == "int8" else operators.dequantize_int4)(q, s, k, torch.bfloat16)
            out.append(
                {"q": q, "s": s, "bytes": q.numel() * q.element_size() + s.numel() * s.element_size(), "dense": deq}
            )
    return out


def _call(fmt: str, x: torch.Tensor, m: dict, k: int, native: bool) -> torch.Tensor:
    if not native:
        return torch.nn.functional.linear(x, m["dense"])
    if fmt in ("bfloat16", "float32"):
        return operators.linear(x, m["w"], None)
    if fmt == "fp8":
        return operators.linear_fp8(x, m["q"], m["s"], None, 128, 128)
    if fmt == "mxfp4":
        return operators.linear_mxfp4(x, m["q"], m["s"], None)
    op = operators.linear_q8 if fmt == "int8" else operators.linear_q4
    return op(x, m["q"], m["s"], None, k)


def _time(fmt: str, mats: list[dict], rows: int, k: int, native: bool, sweeps: int) -> tuple[float, float]:
    """Bytes per second over ``sweeps`` passes through all matrices (one product each): ``(sustained, best)``,
    the first over the whole pass, the second from the fastest single product (what an uncontended step reaches
    on a shared machine, where a neighbour's burst stalls some products)."""
    xdtype = torch.float32 if fmt == "float32" else torch.bfloat16
    x = torch.randn(rows, k).to(xdtype)
    for m in mats[:2]:
        _call(fmt, x, m, k, native)
    fastest = float("inf")
    t0 = time.perf_counter()
    for _ in range(sweeps):
        for m in mats:
            t = time.perf_counter()
            _call(fmt, x, m, k, native)
            fastest = min(fastest, time.perf_counter() - t)
    dt = time.perf_counter() - t0
    return sweeps * sum(m["bytes"] for m in mats) / dt, mats[0]["bytes"] / fastest


def _use(path: str) -> None:
    os.environ["LOADMASTER_CPU_ISA"] = path
    kernel_build.reset()
    st = kernel_build.status()
    if path != "torch" and (not st.available or st.isa != path):
        raise SystemExit(f"the {path} path did not load: {st.reason}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1, help="rows of activations per product (1 = a decode step)")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--matrices-mib", type=int, default=256, help="total weight bytes per format, beyond the caches")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = kernel_build.runnable_isas() + ["torch"]
    rows = []
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            raise SystemExit(f"--formats: unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
        one = _weights(fmt, args.n, args.k, 1)[0]["bytes"]
        mats = _weights(fmt, args.n, args.k, max(2, (args.matrices_mib << 20) // one))
        best = {p: 0.0 for p in paths}
        call = {p: 0.0 for p in paths}
        runs = {p: [] for p in paths}
        for _ in range(args.rounds):
            for p in paths:
                _use(p)
                bw, one = _time(fmt, mats, args.rows, args.k, p != "torch", sweeps=3)
                runs[p].append(round(bw / 1e9, 2))
                best[p] = max(best[p], bw)
                call[p] = max(call[p], one)
        row = {"format": fmt, "matrices": f"{len(mats)} x {args.n}x{args.k}"}
        for p in paths:
            row[f"{p}_gb_s"] = best[p] / 1e9
            row[f"{p}_call_gb_s"] = call[p] / 1e9
            row[f"{p}_runs"] = runs[p]
        if "avx512" in best and "avx2" in best:
            row["avx2_vs_avx512"] = best["avx2"] / best["avx512"]
            row["avx2_vs_avx512_call"] = call["avx2"] / call["avx512"]
        if "avx512" in best or "avx2" in best:
            row["native_vs_torch"] = max(best.get("avx512", 0), best.get("avx2", 0)) / best["torch"]
        rows.append(row)
        print(f"{fmt}: " + ", ".join(f"{p} {best[p] / 1e9:.1f} GB/s" for p in paths), flush=True)
    os.environ.pop("LOADMASTER_CPU_ISA", None)
    cols = [("format", "format"), ("matrices", "matrices")] + [(f"{p}_gb_s", f"{p} GB/s") for p in paths]
    cols += [(f"{p}_call_gb_s", f"{p} best call") for p in paths]
    cols += [
        ("avx2_vs_avx512", "avx2 / avx512"),
        ("avx2_vs_avx512_call", "avx2 / avx512 (calls)"),
        ("native_vs_torch", "native / torch"),
    ]
    print(
        f"\nProducts of {args.rows} row(s), {args.threads} threads, best of {args.rounds} rounds "
        f"(sustained over all matrices, and the best single call), load average {os.getloadavg()[0]:.1f}:\n"
    )
    print_table(rows, cols)
    if args.out:
        write_json(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
