"""Routed experts computed on the CPU: the native kernels' experts forward against transformers' own, side by side.

A MoE whose experts stay in RAM beside GPUs computes them on the CPU (:mod:`loaders.run.cpu_experts`); each decode
step hands each hit expert a few rows, the case :mod:`loaders.native.experts` sends to the native kernels. This
times one Mixtral experts module (fused ``gate_up_proj``/``down_proj``, top-2 of 8, random weights, Mixtral's
proportions scaled down to hidden 1024 x intermediate 3584 so that its 8 experts, 88 MiB in fp32, outgrow the
caches) at 1, 4 and 16 tokens per step, in fp32 and bf16: transformers' eager experts forward, then the same
routing through ``native_experts_forward``, one after the other on the same inputs; each figure is the best of
``--rounds`` rounds' means.

Run from the repository root: ``.venv/bin/python -m bench.moe_experts [--rounds 5] [--threads 2] [--out FILE]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.common import machine, print_table, write_json

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 1024, 3584, 8, 2
TOKENS = (1, 4, 16)
CALLS_PER_ROUND = 10

COLUMNS = [
    ("dtype", "dtype"),
    ("tokens", "tokens per step"),
    ("torch_ms", "transformers ms"),
    ("native_ms", "native ms"),
    ("speedup", "native speed-up"),
]


def experts_module(dtype: torch.dtype) -> torch.nn.Module:
    """A Mixtral experts module in transformers' fused layout, with random weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral

    config = MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    module = modeling_mixtral.MixtralExperts(config).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def best_mean_s(fn: Callable[[], object], rounds: int) -> float:
    """The best round's mean seconds per call, after a warm-up."""
    with torch.no_grad():
        for _ in range(3):
            fn()
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(CALLS_PER_ROUND):
                fn()
            best = min(best, (time.perf_counter() - t) / CALLS_PER_ROUND)
    return best


def main(argv: list[str] | None = None) -> int:
    from loaders.native.experts import native_experts_forward, takes_native_kernels

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        module = experts_module(dtype)
        if not takes_native_kernels(module):
            raise SystemExit(
                f"{dtype}: the native kernels do not take this experts layout here (see loaders/cpu_kernels)"
            )
        for tokens in TOKENS:
            hidden = torch.randn(tokens, HIDDEN, dtype=dtype)
            index = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
            weights = torch.rand(tokens, TOP_K, dtype=dtype)
            operands = (module, hidden, index, weights)
            theirs = best_mean_s(partial(type(module).forward, *operands), args.rounds)
            ours = best_mean_s(partial(native_experts_forward, *operands), args.rounds)
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "tokens": tokens,
                    "torch_ms": round(theirs * 1e3, 3),
                    "native_ms": round(ours * 1e3, 3),
                    "speedup": round(theirs / ours, 2),
                }
            )
            print(rows[-1], flush=True)
    print_table(rows, COLUMNS)
    print(f"torch threads {torch.get_num_threads()}, load average {machine()['load_average'][0]:.1f}")
    if args.out:
        write_json(args.out, {"machine": machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
