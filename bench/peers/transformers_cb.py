"""Transformers' own serving paths on the benchmark Llamas, side by side in one process: batched ``generate``
(left-padded, one call for all prompts), continuous batching (``generate_batch``: paged cache and scheduler, what
``transformers serve --continuous-batching`` runs), and a lone ``generate``.

    .venv/bin/python -m bench.peers.transformers_cb --size 100m --dtype float32 --clients 16 --max-new-tokens 64

Prints one JSON line (``BENCH_RESULT {...}``) with aggregate tokens/s of each, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from bench.common import RESULT_PREFIX, llama_dir
from bench.serve import prompts

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="100m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated contenders to skip: batched,cb,lone")
    p.add_argument("--model", default=None, help="model directory (default: the benchmark Llama of --size)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--worker", default=None, help="JSON spec from bench.serve (model, dtype, texts, ...)")
    args = p.parse_args(argv)
    texts_given: list[str] | None = None
    if args.worker:
        spec = json.loads(args.worker)
        args.model, args.dtype, texts_given = spec["model"], spec["dtype"], spec["texts"]
        args.max_new_tokens, args.repeats, args.threads = spec["max_new_tokens"], spec["repeats"], spec["threads"]
        args.clients = len(texts_given)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or llama_dir(args.size, args.dtype)
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = texts_given or prompts(args.clients)
    ids = [tok(t)["input_ids"] for t in texts]
    skip = set(args.skip.split(","))
    out: dict[str, float] = {}
    n = args.max_new_tokens

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            times.append(fn())
            log.warning("%s took %.2fs", getattr(fn, "__name__", "run"), times[-1])
        return min(times)

    if "batched" not in skip or "lone" not in skip:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)

        def batched() -> float:
            enc = tok(texts, return_tensors="pt", padding=True)
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(**enc, **gen)
            return time.perf_counter() - t0

        def lone() -> float:
            enc = tok(texts[:1], return_tensors="pt")
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(**enc, **gen)
            return time.perf_counter() - t0

        if "batched" not in skip:
            batched()
            out["generate_batched_tps"] = round(args.clients * n / best(batched), 2)
        if "lone" not in skip:
            lone()
            out["generate_lone_tps"] = round(n / best(lone), 2)
        del model

    if "cb" not in skip:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=-1)
        # a cache for the benchmark's requests (its default sizes the cache to a share of free memory, gigabytes)
        cb_config = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)

        def cb(batch: list[list[int]]) -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                res = model.generate_batch(inputs=batch, generation_config=cfg, continuous_batching_config=cb_config)
            took = time.perf_counter() - t0
            made = sum(len(r.generated_tokens) for r in res.values())
            if made != len(batch) * n:
                log.warning("continuous batching made %d tokens, expected %d", made, len(batch) * n)
            return took

        log.warning("continuous batching: warm-up")
        cb(ids[:2])
        out["continuous_batching_tps"] = round(args.clients * n / best(lambda: cb(ids)), 2)
        out["continuous_batching_lone_tps"] = round(n / best(lambda: cb(ids[:1])), 2)
    out.update(
        model=str(model_dir),
        size=None if args.model else args.size,  # a given model directory is named by its path, not by --size
        dtype=args.dtype,
        clients=args.clients,
        max_new_tokens=n,
        threads=torch.get_num_threads(),
    )
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
