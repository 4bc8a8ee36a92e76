"""``python -m service.cli.pipeline_command MODEL --prompt TEXT``: greedy generation over a pipeline, one rank per host,
launched by ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``).

Every rank runs the same command line: it plans the cluster itself (one host per rank, the planning flags apply
to each), checks that it agrees with rank 0, loads only its stage and runs. Rank 0 tokenizes, drives and prints one
JSON line per prompt. Exit codes: 0 done, 2 bad input (one line saying what to change), 1 the group broke (a rank
died, hung past ``--timeout``, or planned differently): a supervisor should restart every rank.

Rank 0 generates through the engine and the ring of ``loadmaster serve --pipeline``
(:class:`~service.pipeline.greedy_driver.PipelineDriver`); the other ranks run the same stage loop as behind the server
(:func:`~service.pipeline.stage_loop.serve_stage`). Each prompt gets exactly ``--max-new-tokens`` greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from loaders.errors import CheckpointError
from loaders.load import load_stage, load_tokenizer
from planner.errors import PlanError
from planner.hardware.units import parse_rate
from service.cli.plan_command import add_planner_flags, inputs_from_args
from service.pipeline.greedy_driver import PipelineDriver
from service.pipeline.stage_loop import serve_stage
from service.pipeline.wire import PipelineBrokenError, PipelineMismatchError, check_same_plan

log = logging.getLogger("loadmaster.pipeline")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nnodes N --nproc-per-node 1 ... -m service.cli.pipeline_command",
        description="Greedy generation over a pipeline of torch.distributed ranks, one stage per rank.",
    )
    p.add_argument("model", help="model directory (config.json + safetensors + tokenizer), the same path on every host")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    add_planner_flags(p)
    p.add_argument("--inter-host-bandwidth", default=None, metavar="RATE", help="link between hosts, e.g. 100Gb")
    p.add_argument("--micro-batches", type=int, default=None, help="default: min(prompts, ranks)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a rank may stay silent before the group fails")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    return p


def main(argv: list[str] | None = None) -> int:
    from service import log_text

    log_text.install(logging.INFO, "%(asctime)s rank%(process)d %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.stderr.write("loadmaster pipeline: error: start it with torchrun (RANK and WORLD_SIZE are not set)\n")
        return 2
    if args.max_new_tokens < 1 or args.timeout <= 0:
        sys.stderr.write("loadmaster pipeline: error: --max-new-tokens and --timeout must be positive\n")
        return 2
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":  # this rank's GPU: where NCCL's tensors (and the wire of its Link) live
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        from planner.cluster import plan_cluster

        host = inputs_from_args(args)
        plan = plan_cluster(
            args.model,
            [host] * world,
            dtype=host.dtype,
            quantization=host.quantization,
            batch_size=len(args.prompt),
            context=host.context,
            strategy=host.strategy if isinstance(host.strategy, str) else "auto",
            micro_batches=args.micro_batches,
            inter_host_bandwidth=parse_rate(args.inter_host_bandwidth),
        )
        check_same_plan(plan)
        stage = load_stage(args.model, plan, rank)
        if rank != 0:
            serve_stage(stage)
            return 0
        tokenizer = load_tokenizer(args.model)
        prompts = [tokenizer(p)["input_ids"] for p in args.prompt]
        driver = PipelineDriver(stage, plan)
        outputs = driver.generate_greedy(prompts, args.max_new_tokens)
        driver.stop()
        for prompt, ids in zip(args.prompt, outputs):
            print(json.dumps({"prompt": prompt, "token_ids": ids, "text": tokenizer.decode(ids)}), flush=True)
        return 0
    except (PlanError, CheckpointError) as e:
        sys.stderr.write(f"loadmaster pipeline: error (rank {rank}): {str(e).splitlines()[0]}\n")
        return 2
    except (PipelineBrokenError, PipelineMismatchError) as e:
        sys.stderr.write(f"loadmaster pipeline: error (rank {rank}): {e}\n")
        os._exit(1)  # the group is broken: leave without waiting on collectives that will never complete


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
