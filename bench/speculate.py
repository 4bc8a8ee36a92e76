"""One stream with and without ``--speculate ngram`` (issue 35): decode tokens/s, best of ``--repeats``, and the
acceptance the drafts really had, on the trained demo model (``service.model.demo_model.build_demo_model``, as
``loadmaster serve --demo`` serves it; ``$LOADMASTER_HOME/demo-model``, built once, about a minute) or ``--model DIR``.

The model is loaded as the server loads it (``loaders.load.load_model`` on the CPU: the native kernels) and driven
through the engine itself, one greedy request at a time with ``ignore_eos`` so both modes generate the same count;
the two modes' tokens are checked equal. A speed-up means nothing without its acceptance: both are printed.

Run: ``.venv/bin/python -m bench.speculate [--model DIR] [--new-tokens 128] [--repeats 3] [--threads 2]``
"""

from __future__ import annotations

import argparse
import queue
import time
from pathlib import Path

import torch

from bench.common import machine, print_table, write_json

PROMPT = "Once upon a time"


def _one_stream(engine, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """One greedy request: its tokens and its decode rate (tokens after the first over the time since the first)."""
    from service.engine.requests import ErrorEvent, FinishEvent, GenerationRequest, TokenEvent

    sink: queue.Queue = queue.Queue()
    request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=new_tokens, ignore_eos=True)
    engine.submit(request, sink.put)
    tokens: list[int] = []
    first = last = 0.0
    while True:
        ev = sink.get(timeout=600)
        if isinstance(ev, ErrorEvent):
            raise SystemExit(ev.message)
        if isinstance(ev, TokenEvent):
            last = time.perf_counter()
            first = first or last
            tokens.append(ev.id)
        if isinstance(ev, FinishEvent):
            return tokens, (len(tokens) - 1) / (last - first) if last > first else 0.0


def run(path: Path, prompt: str, new_tokens: int, repeats: int, draft_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    from loaders.load import load_model
    from service.engine.engine import Engine

    model = load_model(path, {"": "cpu"}, show_progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = tok(prompt)["input_ids"]
    engines = {
        mode: Engine(model, tok, max_batch_size=1, prefix_cache=False, speculate=mode, speculate_tokens=draft_tokens)
        for mode in ("off", "ngram")
    }
    rates: dict[str, list[float]] = {mode: [] for mode in engines}
    outputs: dict[str, list[int]] = {}
    for engine in engines.values():
        engine.start()
    try:
        for _ in range(repeats):  # side by side: a contended CPU slows both modes alike
            for mode, engine in engines.items():
                outputs[mode], rate = _one_stream(engine, prompt_ids, new_tokens)
                rates[mode].append(rate)
    finally:
        for engine in engines.values():
            engine.stop()
    rows = []
    for mode, engine in engines.items():
        stats = engine.speculator.stats
        rows.append(
            {
                "mode": mode,
                "decode_tok_s": max(rates[mode]),
                "acceptance": stats.acceptance_rate,
                "tokens_per_pass": stats.tokens_per_pass,
                "proposed": stats.proposed,
            }
        )
    rows[1]["speedup"] = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"] if rows[0]["decode_tok_s"] else None
    rows[1]["same_tokens"] = outputs["ngram"] == outputs["off"]
    rows[0]["same_tokens"] = True
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the trained demo model)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=4, help="--speculate-tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from service.model.demo_model import build_demo_model

        path = build_demo_model()
    rows = run(path, args.prompt, args.new_tokens, args.repeats, args.draft_tokens)
    print(f"\nOne stream, {args.new_tokens} greedy tokens, best of {args.repeats}; model {path}\n")
    print_table(
        rows,
        [
            ("mode", "speculate"),
            ("decode_tok_s", "decode tok/s"),
            ("speedup", "speed-up"),
            ("acceptance", "acceptance"),
            ("tokens_per_pass", "tokens/verify pass"),
            ("same_tokens", "same tokens"),
        ],
    )
    if args.out:
        write_json(args.out, {"machine": machine(), "model": str(path), "rows": rows})
    return 0 if rows[1]["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
