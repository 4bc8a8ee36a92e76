"""One stream with and without speculation (issue 35): decode tokens/s, best of ``--repeats``, and the acceptance
the drafts really had, for each ``--modes`` (``off`` first: ``ngram`` prompt lookup, ``int4``/``int8`` the model's
own weights quantized as the draft model), on the trained demo model (``service.model.demo_model.build_demo_model``,
as ``loadmaster serve --demo`` serves it; ``$LOADMASTER_HOME/demo-model``, built once, about a minute) or
``--model DIR``.

The model is loaded as the server loads it (``loaders.load.load_model`` on the CPU: the native kernels; with
``--disk-layers N`` its last N decoder layers are read from the checkpoint per step instead, as past the disk wall)
and driven through the engine itself, one greedy request at a time with ``ignore_eos`` so every mode generates the
same count; each mode's tokens are checked equal to ``off``'s. The draft copies are loaded as the server loads them
(:func:`service.model.draft_copy.load_draft_copy`) and their bytes printed. A speed-up means nothing without its
acceptance: both are printed.

With ``--clients N`` the N prompts of ``bench.serve`` go to the engine at once instead (``max_batch_size`` N) and
the rate is the aggregate: every generated token over the wall time from submission to the last finish. That is
issue 35's "nothing lost at 16 clients" run on the random 100M, where drafts mostly fail.

With ``--peers`` llama.cpp's own speculative decoding runs after ours on the same weights, prompt, token count and
threads (:mod:`bench.peers.llamacpp_speculative`; built on first use, never in CI): plain, and with a ``q8_0`` and a
``q4_0`` draft of the model (our ``int8`` and ``int4`` copies' counterparts), best of ``--repeats``; each of our
modes is printed as a ratio to llama.cpp's speculative rate and to its plain one.

Run: ``.venv/bin/python -m bench.speculate [--peers] [--model DIR] [--modes off,ngram,int4,int8] [--new-tokens 128]
[--repeats 3] [--threads 2] [--disk-layers N] [--clients 16]``
"""

from __future__ import annotations

import argparse
import queue
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import machine, print_table, write_json

PROMPT = "Once upon a time"


@dataclass(frozen=True)
class StreamRun:
    """One greedy request's tokens, its decode rate (tokens after the first over the time since the first) and the
    process's CPU milliseconds per such token (less sensitive than the rate to other work on a shared machine)."""

    tokens: list[int]
    tok_s: float
    cpu_ms_per_token: float


def _one_stream(engine, prompt_ids: list[int], new_tokens: int) -> StreamRun:
    from service.engine.requests import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent

    sink: queue.Queue = queue.Queue()
    request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=new_tokens, ignore_eos=True)
    engine.submit(request, sink.put)
    tokens: list[int] = []
    first = last = cpu_first = cpu_last = 0.0
    while True:
        ev = sink.get(timeout=600)
        if isinstance(ev, ErrorEvent):
            raise SystemExit(ev.message)
        if isinstance(ev, TokenEvent):
            last, cpu_last = time.perf_counter(), time.process_time()
            if not tokens:
                first, cpu_first = last, cpu_last
            tokens.append(ev.id)
        if isinstance(ev, FinishEvent):
            after = max(1, len(tokens) - 1)
            rate = (len(tokens) - 1) / (last - first) if last > first else 0.0
            return StreamRun(tokens, rate, (cpu_last - cpu_first) * 1e3 / after)


def _many_streams(engine, prompts: list[list[int]], new_tokens: int) -> StreamRun:
    """All of ``prompts`` submitted at once, as concurrent clients: their tokens, in order, and the aggregate rate
    (every generated token over the wall time from submission to the last finish)."""
    from service.engine.requests import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent

    sinks: list[queue.Queue] = [queue.Queue() for _ in prompts]
    started, cpu_started = time.perf_counter(), time.process_time()
    for ids, sink in zip(prompts, sinks):
        engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens, ignore_eos=True), sink.put)
    tokens: list[int] = []
    for sink in sinks:
        while True:
            ev = sink.get(timeout=600)
            if isinstance(ev, ErrorEvent):
                raise SystemExit(ev.message)
            if isinstance(ev, TokenEvent):
                tokens.append(ev.id)
            if isinstance(ev, FinishEvent):
                break
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return StreamRun(tokens, len(tokens) / wall, cpu * 1e3 / max(1, len(tokens)))


def run(
    path: Path,
    prompt: str,
    new_tokens: int,
    repeats: int,
    draft_tokens: int,
    modes: list[str],
    disk_layers: int,
    always_draft: bool = False,
    clients: int = 1,
) -> list[dict]:
    from transformers import AutoTokenizer

    from loaders.load import load_model
    from service.engine.engine import Engine
    from service.model.draft_copy import DRAFT_SCHEMES, load_draft_copy

    if modes[0] != "off":
        raise SystemExit("--modes must start with off: every mode is compared with it")
    offload = Path(tempfile.mkdtemp(prefix="bench-speculate-"))  # used only for tensors that must be cast
    model = load_model(path, _device_map(path, disk_layers), offload_folder=offload, show_progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = tok(prompt)["input_ids"]
    if clients > 1:
        from bench.serve import prompts as client_prompts

        many = [tok(text)["input_ids"] for text in client_prompts(clients)]
    copies = {mode: load_draft_copy(path, mode, "float32") for mode in modes if mode in DRAFT_SCHEMES}
    engines = {
        mode: Engine(
            model,
            tok,
            max_batch_size=clients,
            prefix_cache=False,
            speculate=mode,
            speculate_tokens=draft_tokens,
            draft_model=copies[mode].model if mode in copies else None,
        )
        for mode in modes
    }
    for engine in engines.values():
        engine.speculator.gate.measure = not always_draft  # always: what drafting every step costs and gets
    runs: dict[str, list[StreamRun]] = {mode: [] for mode in engines}
    outputs: dict[str, list[int]] = {}
    for engine in engines.values():
        engine.start()
    try:
        for _ in range(repeats):  # side by side: a contended CPU slows every mode alike
            for mode, engine in engines.items():
                if clients > 1:
                    stream = _many_streams(engine, many, new_tokens)
                else:
                    stream = _one_stream(engine, prompt_ids, new_tokens)
                outputs[mode] = stream.tokens
                runs[mode].append(stream)
    finally:
        for engine in engines.values():
            engine.stop()
    rows = []
    for mode, engine in engines.items():
        stats = engine.speculator.stats
        rows.append(
            {
                "mode": mode,
                "decode_tok_s": max(r.tok_s for r in runs[mode]),
                "cpu_ms_per_token": min(r.cpu_ms_per_token for r in runs[mode]),
                "acceptance": stats.acceptance_rate,
                "tokens_per_pass": stats.tokens_per_pass,
                "proposed": stats.proposed,
                "verify_passes": stats.verify_passes,
                "draft_mib": copies[mode].nbytes / (1 << 20) if mode in copies else None,
                "same_tokens": outputs[mode] == outputs["off"],
            }
        )
    base = rows[0]["decode_tok_s"]
    for row in rows[1:]:
        row["speedup"] = row["decode_tok_s"] / base if base else None
        row["cpu_ratio"] = rows[0]["cpu_ms_per_token"] / row["cpu_ms_per_token"] if row["cpu_ms_per_token"] else None
    return rows


def _llamacpp_rows(path: Path, args: argparse.Namespace) -> list[dict]:
    """llama.cpp on the same weights: plain greedy decode and its speculative example with q8_0 and q4_0 drafts,
    best of ``--repeats`` each, the runs alternating."""
    from bench.common import model_cache_dir
    from bench.peers import llamacpp_speculative as peer

    cache = model_cache_dir().parent / "peers"
    bin_dir = peer.tools(cache)
    target = peer.gguf(bin_dir, path, cache, "f32")
    drafts = {kind: peer.gguf(bin_dir, path, cache, kind) for kind in ("q8_0", "q4_0")}
    threads = args.threads or torch.get_num_threads()
    runs: dict[str, list] = {"plain": [], **{f"draft {kind}": [] for kind in drafts}}
    for _ in range(args.repeats):
        runs["plain"].append(peer.plain(bin_dir, target, args.prompt, args.new_tokens, threads))
        for kind, draft in drafts.items():
            runs[f"draft {kind}"].append(
                peer.speculative(bin_dir, target, draft, args.prompt, args.new_tokens, threads, args.draft_tokens)
            )
    rows = []
    for mode, rs in runs.items():
        best = max(rs, key=lambda r: r.tok_s)
        rows.append({"mode": mode, "decode_tok_s": best.tok_s, "acceptance": best.acceptance})
    return rows


def _device_map(path: Path, disk_layers: int) -> dict[str, str]:
    """Everything on the CPU, but the last ``disk_layers`` decoder layers read from the checkpoint each step."""
    if disk_layers <= 0:
        return {"": "cpu"}
    import json

    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    return {"": "cpu", **{f"model.layers.{i}": "disk" for i in range(max(0, layers - disk_layers), layers)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the trained demo model)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=4, help="--speculate-tokens")
    parser.add_argument("--modes", default="off,ngram", help="comma-separated, off first (off,ngram,int4,int8)")
    parser.add_argument("--disk-layers", type=int, default=0, help="last N decoder layers read from disk per step")
    parser.add_argument(
        "--always-draft", action="store_true", help="keep the step gate open: every step drafts (acceptance, cost)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clients", type=int, default=1, help="concurrent requests (distinct prompts): aggregate tokens/s instead"
    )
    parser.add_argument("--peers", action="store_true", help="also run llama.cpp's speculative example (not in CI)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from service.model.demo_model import build_demo_model

        path = build_demo_model()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = run(
        path,
        args.prompt,
        args.new_tokens,
        args.repeats,
        args.draft_tokens,
        modes,
        args.disk_layers,
        args.always_draft,
        args.clients,
    )
    disk = f", last {args.disk_layers} layers on disk" if args.disk_layers else ""
    disk += ", gate held open" if args.always_draft else ""
    streams = "One stream" if args.clients == 1 else f"{args.clients} concurrent streams (aggregate)"
    print(f"\n{streams}, {args.new_tokens} greedy tokens each, best of {args.repeats}; model {path}{disk}\n")
    print_table(
        rows,
        [
            ("mode", "speculate"),
            ("decode_tok_s", "decode tok/s"),
            ("speedup", "speed-up"),
            ("cpu_ms_per_token", "CPU ms/token"),
            ("cpu_ratio", "CPU ratio"),
            ("acceptance", "acceptance"),
            ("tokens_per_pass", "tokens/verify pass"),
            ("verify_passes", "verify passes"),
            ("draft_mib", "draft MiB"),
            ("same_tokens", "same tokens"),
        ],
    )
    peers = _llamacpp_rows(path, args) if args.peers else []
    for peer in peers:
        print(f"llama.cpp {peer['mode']}: {peer['decode_tok_s']:.1f} tok/s, acceptance {peer['acceptance']}")
    if peers:
        best_spec = max(p["decode_tok_s"] for p in peers if p["mode"] != "plain")
        plain = next(p["decode_tok_s"] for p in peers if p["mode"] == "plain")
        for row in rows:
            print(
                f"ours {row['mode']}: {row['decode_tok_s'] / best_spec:.2f}x llama.cpp's best speculative, "
                f"{row['decode_tok_s'] / plain:.2f}x its plain decode"
            )
    if args.out:
        write_json(
            args.out,
            {
                "machine": machine(),
                "model": str(path),
                "disk_layers": args.disk_layers,
                "always_draft": args.always_draft,
                "clients": args.clients,
                "rows": rows,
                "llamacpp": peers,
            },
        )
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
