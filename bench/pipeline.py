"""Greedy decode tokens/s of one process against a pipeline of 2 and 3 ranks (gloo on loopback), side by side,
with the cluster cost model's prediction for each.

    python -m bench.pipeline [--size tiny|100m] [--new-tokens 16] [--repeats 3]

"Sequences" is the batch decoded together (1 and 16); the pipeline splits it into min(batch, ranks) micro-batches.
One process is the model's own transformers class with the same left-padded greedy loop. Every figure is the best
of ``--repeats`` runs in one invocation. On a machine with fewer cores than ranks, ranks share cores, so no
speed-up is expected: see docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from bench.common import llama_dir, machine, print_table

BATCHES = (1, 16)
PROMPT_LEN = 16


def _prompts(batch: int) -> list[list[int]]:
    return [[(7 * r + 3 * i) % 900 + 10 for i in range(PROMPT_LEN)] for r in range(batch)]


def _one_process(model_dir: Path, new_tokens: int, repeats: int) -> dict[int, float]:
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for batch in BATCHES:
            ids = torch.tensor(_prompts(batch))
            best = float("inf")
            for i in range(repeats + 1):  # the first run warms up (allocator, lazy imports) and is dropped
                t0 = time.perf_counter()
                cache = DynamicCache(config=model.config)
                mask = torch.ones_like(ids)
                logits = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
                for _ in range(new_tokens - 1):
                    nxt = logits.argmax(-1, keepdim=True)
                    mask = torch.cat([mask, mask.new_ones((batch, 1))], 1)
                    logits = model(input_ids=nxt, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
                best = min(best, time.perf_counter() - t0) if i else best
            out[batch] = batch * new_tokens / best
    return out


def _rank(rank: int, world: int, port: int, model_dir: str, new_tokens: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from loaders.pipeline_stage import load_stage
    from planner.cluster import plan_cluster
    from planner.inputs import PlanInputs
    from service.pipeline import PipelineDriver, check_same_plan, serve_stage

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    result = {}
    for batch in BATCHES:
        plan = plan_cluster(model_dir, [PlanInputs(max_memory={"cpu": "8GiB"})] * world, batch_size=batch, context=64)
        check_same_plan(plan)
        stage = load_stage(model_dir, plan, rank)
        if rank == 0:
            driver = PipelineDriver(stage, plan.micro_batches)
            best = float("inf")
            for i in range(repeats + 1):  # the first run warms up and is dropped
                t0 = time.perf_counter()
                driver.generate_greedy(_prompts(batch), new_tokens)
                best = min(best, time.perf_counter() - t0) if i else best
            driver.stop()
            result[batch] = {"tps": batch * new_tokens / best, "predicted": plan.prediction.decode_tokens_per_s}
        else:
            serve_stage(stage)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _pipeline(model_dir: Path, world: int, new_tokens: int, repeats: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        mp.start_processes(
            _rank, args=(world, port, str(model_dir), new_tokens, repeats, out), nprocs=world, start_method="spawn"
        )
        return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


def _predicted_one_host(model_dir: Path, batch: int) -> float:
    from planner import plan

    return plan(model_dir, max_memory={"cpu": "8GiB"}, batch_size=batch, context=64).prediction.decode_tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", choices=("tiny", "100m"))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.size == "tiny":
        from bench.common import model_cache_dir
        from service.random_models import build_model

        model_dir = build_model("llama", model_cache_dir() / "tiny-llama", size="tiny")
    else:
        model_dir = llama_dir("100m", "float32")
    rows = []
    single = _one_process(model_dir, a.new_tokens, a.repeats)
    for batch in BATCHES:
        rows.append(
            {
                "setup": "1 process",
                "sequences": batch,
                "tokens/s": round(single[batch], 1),
                "predicted": round(_predicted_one_host(model_dir, batch), 1),
                "vs 1 process": 1.0,
            }
        )
    for world in (2, 3):
        res = _pipeline(model_dir, world, a.new_tokens, a.repeats)
        for batch in BATCHES:
            rows.append(
                {
                    "setup": f"{world} ranks",
                    "sequences": batch,
                    "tokens/s": round(res[batch]["tps"], 1),
                    "predicted": round(res[batch]["predicted"], 1),
                    "vs 1 process": round(res[batch]["tps"] / single[batch], 2),
                }
            )
    info = machine()
    print(f"model: llama {a.size} fp32, prompt {PROMPT_LEN} tokens, {a.new_tokens} new tokens, best of {a.repeats}")
    print(f"machine: {info}")
    print_table(rows, [(k, k) for k in ("setup", "sequences", "tokens/s", "predicted", "vs 1 process")])


if __name__ == "__main__":
    main()
