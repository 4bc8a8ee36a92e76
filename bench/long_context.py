"""Decode speed at a long context: ``--rows`` sequences of ``--context`` tokens each, decoding together.

At a decode step every row reads its whole KV cache once, so the attention's share of a step grows with the
context: at 16 rows of 2000 tokens it is about as large as the weights' products. This bench times that regime side
by side, each contender in a fresh process, the contenders alternating round by round (best of the rounds):

- ``loadmaster``: the engine's model runner over the slot cache, as ``loadmaster serve`` runs it (the native decode
  step where the model takes it), the prompts prefilled in 512-token chunks;
- ``transformers``: batched greedy ``generate`` on the same prompts and weights (its own cache, SDPA);
- ``llama.cpp`` (``--peers``): the same weights as GGUF in the same dtype, the same prompts, one batch per step.

Each reports the decode rate: rows x tokens per second from the median step after the prompts (prefill excluded;
the median, so one step stalled by a neighbour on this shared machine does not count).

    .venv/bin/python -m bench.long_context --size 100m --dtype bfloat16 --rows 16 --context 2000 --peers
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import (
    emit,
    llama_dir,
    machine,
    median_rate,
    model_cache_dir,
    print_table,
    run_isolated,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 512  # prompt tokens per prefill call (the engine's default chunk)
CONTENDERS = ("loadmaster", "transformers", "llama.cpp")


def prompt_ids(rows: int, context: int, vocab: int) -> list[list[int]]:
    """Different token ids per row, past the first few (special) ids of the tokenizer."""
    span = vocab - 8
    return [[8 + (r * 7919 + i * 31) % span for i in range(context)] for r in range(rows)]


def decode_rate(rows: int, times: list[float]) -> float:
    """rows x tokens per second from the median gap between consecutive steps' clocks."""
    return rows * median_rate(times)


def loadmaster_worker(spec: dict) -> dict:
    import torch

    from loaders import load_model
    from service.engine.kv_pool import SlotKVCache
    from service.engine.model_runner import ModelRunner, Row

    torch.set_num_threads(int(spec["threads"]))
    path, new = Path(spec["model"]), int(spec["new_tokens"])
    model = load_model(path, device_map={"": "cpu"}, show_progress=False).eval()
    prompts = prompt_ids(int(spec["rows"]), int(spec["context"]), int(model.config.vocab_size))
    runner = ModelRunner(model, torch.device("cpu"), SlotKVCache(len(prompts), len(prompts[0]) + new + 8))
    with torch.inference_mode():
        last = []
        for slot, ids in enumerate(prompts):
            for start in range(0, len(ids), CHUNK):
                out = runner.run([Row(slot, start, ids[start : start + CHUNK])])
            last.append(int(out.last[0].argmax()))
        tokens = [[t] for t in last]
        times = [time.perf_counter()]
        for step in range(new - 1):
            out = runner.run([Row(s, len(ids) + step, [last[s]]) for s, ids in enumerate(prompts)])
            last = [int(t) for t in out.last.argmax(-1)]
            times.append(time.perf_counter())
            for seq, t in zip(tokens, last):
                seq.append(t)
    native = runner.native_decoder is not None and runner.native_decoder.steps >= new - 1
    return {"decode_tok_s": decode_rate(len(prompts), times), "native_step": native, "tokens": tokens}


def transformers_worker(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        """The time of each step's logits (generate calls processors once per step)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            self.times.append(time.perf_counter())
            return scores

    torch.set_num_threads(int(spec["threads"]))
    path, new = Path(spec["model"]), int(spec["new_tokens"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, spec["dtype"])).eval()
    prompts = prompt_ids(int(spec["rows"]), int(spec["context"]), int(model.config.vocab_size))
    ids = torch.tensor(prompts)
    clock = Clock()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=model.config.pad_token_id,
        )
    return {"decode_tok_s": decode_rate(len(prompts), clock.times), "tokens": out[:, ids.shape[1] :].tolist()}


def llamacpp_worker(spec: dict) -> dict:
    from bench.peers import llamacpp

    llamacpp.ensure_installed()
    path, new = Path(spec["model"]), int(spec["new_tokens"])
    gguf = llamacpp.gguf_file(path, Path(spec["cache"]), llamacpp.GGUF_TYPE[spec["dtype"]])
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = prompt_ids(int(spec["rows"]), int(spec["context"]), vocab)
    with llamacpp.loaded(gguf, int(spec["threads"]), len(prompts), len(prompts[0]) + new + 8, CHUNK) as llm:
        last = []
        for seq, ids in enumerate(prompts):
            for start in range(0, len(ids), CHUNK):
                piece = ids[start : start + CHUNK]
                items = [(t, start + i, seq, start + i == len(ids) - 1) for i, t in enumerate(piece)]
                got = llm.decode(items)
            last.append(got[0])
        times = [time.perf_counter()]
        for step in range(new - 1):
            last = llm.decode([(last[s], len(ids) + step, s, True) for s, ids in enumerate(prompts)])
            times.append(time.perf_counter())
    return {"decode_tok_s": decode_rate(len(prompts), times), "gguf_type": llamacpp.GGUF_TYPE[spec["dtype"]]}


WORKERS = {"loadmaster": loadmaster_worker, "transformers": transformers_worker, "llama.cpp": llamacpp_worker}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="100m", choices=["100m", "1b"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=2000, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", action="store_true", help="also time llama.cpp (installed on first use)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        emit(WORKERS[spec["contender"]](spec))
        return 0
    if args.new_tokens < 3 or args.rows < 1 or args.context < 1:
        ap.error("--new-tokens must be at least 3, --rows and --context at least 1")
    model = llama_dir(args.size, args.dtype)
    contenders = [c for c in CONTENDERS if c != "llama.cpp" or args.peers]
    spec = {
        "model": str(model),
        "cache": str(model_cache_dir()),
        "dtype": args.dtype,
        "rows": args.rows,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
    }
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for r in range(args.rounds):
        for c in contenders:
            got = run_isolated("bench.long_context", {**spec, "contender": c})
            if "error" in got:
                print(f"{c}: {got['error']}", file=sys.stderr)
                return 1
            runs[c].append(got)
            print(f"round {r + 1}: {c} {got['decode_tok_s']:.1f} tok/s", flush=True)
    best = {c: max(x["decode_tok_s"] for x in runs[c]) for c in contenders}
    ours, theirs = runs["loadmaster"][0]["tokens"], runs["transformers"][0]["tokens"]
    agree = sum(a == b for a, b in zip(ours, theirs))
    # in bf16 two correct kernels that sum in different orders may round a near-tie apart; fp32 must agree
    print(f"greedy tokens equal to transformers' for {agree} of {len(ours)} rows")
    rows = [
        {"contender": c, "decode_tok_s": round(best[c], 1), "x_ours": round(best["loadmaster"] / best[c], 2)}
        for c in contenders
    ]
    title = f"{args.size} {args.dtype}, {args.rows} rows x {args.context} tokens, {args.threads} threads"
    print(title)
    print_table(rows, [("contender", "contender"), ("decode_tok_s", "decode tok/s"), ("x_ours", "ours x it")])
    if not all(x.get("native_step", True) for x in runs["loadmaster"]):
        print("note: the native decode step did not run every step", file=sys.stderr)
    if args.out:
        for got in runs.values():
            for run in got:
                run.pop("tokens", None)
        write_json(
            args.out, {"machine": machine(), "setting": spec, "best": rows, "rows_agreeing": agree, "runs": runs}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
