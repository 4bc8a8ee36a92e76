"""Greedy decode tokens/s of one process against a pipeline of 2 and 3 ranks (gloo on loopback), side by side,
with the cluster cost model's prediction for each.

    python -m bench.pipeline [--size tiny|100m] [--new-tokens 16] [--repeats 3]
    python -m bench.pipeline --serve [--size tiny|100m] [--new-tokens 16] [--repeats 3]

``--serve`` measures the HTTP server instead: ``loadmaster serve`` in one process against
``torchrun ... serve --pipeline`` with 2 and 3 ranks, at 1 and 16 concurrent clients (TGI ``/generate``), each
client sending two requests; tokens/s is all generated tokens over the wall time of the run.

"Sequences" is the batch decoded together (1 and 16); the pipeline splits it into min(batch, ranks) micro-batches.
The pipeline runs rank 0's engine over the ring (``service.pipeline.greedy_driver``, as ``serve --pipeline`` does);
one process is the model's own transformers class with a plain greedy loop. Every figure is the best
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

    from loaders.load import load_stage
    from planner.cluster import plan_cluster
    from planner.placement.inputs import PlanInputs
    from service.pipeline.greedy_driver import PipelineDriver
    from service.pipeline.stage_loop import serve_stage
    from service.pipeline.wire import check_same_plan

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
            driver = PipelineDriver(stage, plan)
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


def _serve_command(model_dir: Path, world: int, port: int) -> list[str]:
    import sys

    threads = str(max(1, (os.cpu_count() or 1) // world))
    flags = ["serve", str(model_dir), "--port", str(port), "--max-batch-size", "16", "--max-total-tokens", "512"]
    flags += ["--max-concurrent-requests", "256", "--log-level", "warning", "--threads", threads]
    if world == 1:
        return [sys.executable, "-m", "service.cli", *flags]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", str(world), "-m", "service.cli", *flags, "--pipeline"]


def _serve_rows(model_dir: Path, new_tokens: int, repeats: int) -> list[dict]:
    """Tokens/s of the server at 1 and 16 clients: one process, then pipelines of 2 and 3 ranks."""
    import signal
    import subprocess

    from bench.common import wait_ready
    from bench.serve import prompts, run_clients

    rows: list[dict] = []
    base: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2, 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            log = Path(tmp) / f"serve{world}.log"
            env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
            with log.open("w") as out:
                proc = subprocess.Popen(
                    _serve_command(model_dir, world, port), stdout=out, stderr=subprocess.STDOUT, env=env
                )
            try:
                wait_ready(url, proc)
                run_clients(url, prompts(2), 1, 4)  # warm-up
                for clients in BATCHES:
                    best = 0.0
                    for _ in range(repeats):
                        res = run_clients(url, prompts(2 * clients), clients, new_tokens)
                        if res["errors"]:
                            raise RuntimeError(f"{world} rank(s): {res['errors'][:3]}")
                        best = max(best, res["tokens_per_s"])
                    base.setdefault(clients, best)
                    rows.append(
                        {
                            "setup": "1 process" if world == 1 else f"{world} ranks",
                            "clients": clients,
                            "tokens/s": round(best, 1),
                            "vs 1 process": round(best / base[clients], 2),
                        }
                    )
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", choices=("tiny", "100m"))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help="measure the HTTP server (serve vs serve --pipeline)")
    a = ap.parse_args()
    if a.size == "tiny":
        from bench.common import model_cache_dir
        from service.model.random_models import build_model

        model_dir = build_model("llama", model_cache_dir() / "tiny-llama", size="tiny")
    else:
        model_dir = llama_dir("100m", "float32")
    if a.serve:
        rows = _serve_rows(model_dir, a.new_tokens, a.repeats)
        print(f"model: llama {a.size} fp32, {a.new_tokens} new tokens, 2 requests per client, best of {a.repeats}")
        print(f"machine: {machine()}")
        print_table(rows, [(k, k) for k in ("setup", "clients", "tokens/s", "vs 1 process")])
        return
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
