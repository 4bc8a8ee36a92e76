"""Real torch.distributed ranks (gloo on loopback) for the pipeline tests, started by torch.multiprocessing.

Each rank plans the cluster itself, checks the plan against rank 0's, loads only its stage and runs; rank 0 writes
what it generated, and every rank what it read and holds, to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, port: int, job: dict) -> None:
    import torch

    from loaders.load import load_stage
    from planner.cluster import plan_cluster
    from planner.placement.inputs import PlanInputs
    from service.pipeline.greedy_driver import PipelineDriver
    from service.pipeline.stage_loop import serve_stage
    from service.pipeline.wire import PipelineBrokenError, check_same_plan

    torch.set_num_threads(1)  # several ranks share two cores here: spinning OpenMP pools would starve each other
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=job.get("timeout_s", 60)),
    )
    out = Path(job["out"])
    try:
        context = job.get("context", 64) + (job.get("context_skew", 0) if rank == world - 1 else 0)
        plan = plan_cluster(
            job["model"],
            [PlanInputs(max_memory={"cpu": job.get("host_memory", "1GiB")})] * world,
            batch_size=len(job["prompts"]),
            context=context,
            micro_batches=job.get("micro_batches"),
        )
        try:
            check_same_plan(plan)
        except Exception as e:
            (out / f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
            return
        stage = load_stage(job["model"], plan, rank)
        record = {
            "keys_read": stage.keys_read,
            "resident_bytes": stage.resident_bytes,
            "bytes_read": stage.bytes_read,
            "planned_weight_bytes": sum(b.weights for b in plan.stages[rank].plan.budgets),
            "blocks": plan.stages[rank].blocks,
        }
        delay = job.get("delay_s", 0.0)
        if rank == 0:
            driver = PipelineDriver(stage, plan, delay_s=delay)
            t_start = time.perf_counter()
            try:
                record["tokens"] = driver.generate_greedy(job["prompts"], job["max_new_tokens"])
            except PipelineBrokenError as e:
                record.update(broken=str(e), seconds=time.perf_counter() - t_start)
                (out / f"rank{rank}.json").write_text(json.dumps(record))
                raise SystemExit(1) from e
            if job.get("timed_steps"):
                record["step_seconds"] = _timed(driver, job)
            driver.stop()
        else:
            if job.get("kill_rank") == rank:
                threading.Timer(job["kill_after_s"], os._exit, args=(9,)).start()
            serve_stage(stage, delay_s=delay)
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        if not record_broken(out, rank):
            dist.destroy_process_group()


def record_broken(out: Path, rank: int) -> bool:
    path = out / f"rank{rank}.json"
    return path.exists() and "broken" in json.loads(path.read_text())


def _timed(driver, job: dict) -> list[float]:
    import time

    times = []
    for _ in range(job["timed_steps"]):
        t0 = time.perf_counter()
        driver.generate_greedy(job["prompts"], 1)
        times.append(time.perf_counter() - t0)
    return times


#: ``forkserver`` with torch and transformers preloaded: the server imports them once, and each rank forks from it
#: (seconds per rank instead of tens on a loaded machine). Plain ``fork`` of the test process is not safe once it
#: has run torch's OpenMP thread pool (a forked rank can hang in it).
START_METHOD = os.environ.get("LOADMASTER_TEST_START_METHOD", "forkserver")
_PRELOAD = [
    "torch",
    "transformers",
    "loaders.load",
    "service.pipeline.greedy_driver",
    "service.pipeline.stage_loop",
    "tests.service.pipeline.pipeline_ranks",
]


def run_ranks(world: int, job: dict, port: int) -> list[dict]:
    """Start ``world`` ranks, wait for them, and return each rank's record."""
    if START_METHOD == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    ctx = mp.start_processes(rank_main, args=(world, port, job), nprocs=world, join=False, start_method=START_METHOD)
    for p in ctx.processes:
        p.join(timeout=300)
    codes = [p.exitcode for p in ctx.processes]
    records = []
    for r in range(world):
        path = Path(job["out"]) / f"rank{r}.json"
        records.append({**(json.loads(path.read_text()) if path.exists() else {}), "exitcode": codes[r]})
    return records
