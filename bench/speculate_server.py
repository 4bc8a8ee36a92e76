"""Speculative decoding through a real ``loadmaster serve``: one server per ``--speculate`` mode, fresh each round,
the modes alternating, best of the rounds.

``bench.speculate`` runs the engine in its own process, where the caller's thread and the engine's both start
OpenMP regions (libgomp then stops spinning between them, which slows small calls), and a gate that learned in one
repeat keeps its verdicts for the next. Here every round starts a server, which pays its gate's learning again, as
a restarted server would; its HTTP clients are what a user runs.

- ``--clients 1``: one request at a time, ``--requests`` of them on the prompt of ``bench.speculate`` (the best
  whole-request rate: generated tokens over the request's wall time, HTTP and prefill included).
- ``--clients N``: a warm-up of two short requests, then the N prompts of ``bench.serve`` at once (aggregate rate:
  every generated token over the wall time to the last finish). Issue 35's "nothing lost at 16 clients" is
  ``--model <the random 100M> --clients 16``.

After each run the server's ``/info`` speculation (acceptance, tokens per verify pass, verify passes) is printed.

Run: ``.venv/bin/python -m bench.speculate_server [--model DIR] [--modes off,ngram,int4,int8] [--clients 16]
[--rounds 3] [--new-tokens 64] [--threads 2] [--speculate-tokens 4]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import spawn_server, wait_ready
from bench.serve import prompts, run_clients
from bench.speculate import PROMPT


def _one_server(model: Path, port: int, mode: str, args: argparse.Namespace) -> dict:
    """One server of ``mode``: its rate for the run ``args`` ask, and its ``/info`` speculation."""
    import httpx

    flags = ["--no-prefix-cache", "--max-batch-size", str(max(16, args.clients)), "--max-concurrent-requests", "256"]
    flags += ["--speculate", mode, "--speculate-tokens", str(args.speculate_tokens)]
    proc = spawn_server(model, port, Path(f"/tmp/bench-speculate-server-{port}.log"), args.threads, flags)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        if args.clients > 1:
            texts = prompts(args.clients)
            run_clients(url, texts[:2], 2, 8)  # a warm-up, as a server has served before
            out = run_clients(url, texts, args.clients, args.new_tokens)
            if out["errors"]:
                raise SystemExit(f"{mode}: {out['errors'][0]}")
            rate = out["tokens_per_s"]
        else:
            rate = 0.0
            with httpx.Client(base_url=url, timeout=600) as client:
                for _ in range(args.requests):
                    started = time.perf_counter()
                    r = client.post(
                        "/generate",
                        json={"inputs": PROMPT, "parameters": {"max_new_tokens": args.new_tokens, "details": True}},
                    )
                    r.raise_for_status()
                    rate = max(rate, r.json()["details"]["generated_tokens"] / (time.perf_counter() - started))
        info = httpx.get(url + "/info", timeout=30).json().get("speculation") or {}
        return {"tok_s": rate, **{k: info.get(k) for k in ("acceptance_rate", "tokens_per_pass", "verify_passes")}}
    finally:
        proc.terminate()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the trained demo model)")
    p.add_argument("--modes", default="off,ngram,int4,int8", help="comma-separated, off first")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--requests", type=int, default=8, help="lone requests per server (--clients 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--speculate-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=18900)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != "off":
        raise SystemExit("--modes must start with off: every mode is compared with it")
    if args.model is None:
        from service.model.demo_model import build_demo_model

        args.model = build_demo_model()
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for i, mode in enumerate(modes):
            run = _one_server(args.model, args.port + i, mode, args)
            runs[mode].append(run)
            print(f"round {round_ + 1} {mode}: {json.dumps(run)}", flush=True)
    base = max(r["tok_s"] for r in runs["off"])
    what = "lone requests" if args.clients == 1 else f"{args.clients} clients, aggregate"
    print(f"\n{args.model.name}, {what}, {args.new_tokens} tokens, best of {args.rounds} rounds (tok/s):")
    for mode, rs in runs.items():
        best = max(r["tok_s"] for r in rs)
        rounds = ", ".join(f"{r['tok_s']:.1f}" for r in rs)
        print(f"  {mode:6s} {best:8.1f} ({rounds})  x off {best / base:.2f}  last /info: {json.dumps(rs[-1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
