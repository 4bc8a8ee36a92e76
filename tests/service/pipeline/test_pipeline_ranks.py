"""The pipeline on real torch.distributed ranks (gloo over loopback, one process per rank).

Greedy tokens equal plain transformers on the same weights; each rank reads and holds only its stage's tensors;
a model too big for one rank's budget runs over two; micro-batches overlap across stages; a rank that planned
differently is refused with a line naming the difference.
"""

from __future__ import annotations

import re
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM

from planner import plan
from planner.cluster import plan_cluster
from planner.errors import PlanError
from planner.placement.inputs import PlanInputs
from tests.service.pipeline.pipeline_ranks import run_ranks

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [3, 4]]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(model_dir, prompts, n):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize(("fixture", "world"), [("tiny_llama", 2), ("tiny_gpt2", 3), ("tiny_moe", 2)])
def test_greedy_tokens_equal_transformers_and_each_rank_reads_only_its_stage(request, tmp_path, fixture, world):
    model_dir = request.getfixturevalue(fixture)
    job = {"model": str(model_dir), "prompts": PROMPTS, "max_new_tokens": 6, "out": str(tmp_path), "micro_batches": 2}
    records = run_ranks(world, job, _port())
    assert records[0]["tokens"] == _reference(model_dir, PROMPTS, 6)
    read = [set(r["keys_read"]) for r in records]
    for a in range(world):
        for b in range(a + 1, world):
            assert not read[a] & read[b], f"ranks {a} and {b} both read {sorted(read[a] & read[b])[:3]}"
    from loaders.checkpoint.index import CheckpointIndex

    index = CheckpointIndex.open(model_dir)
    assert set().union(*read) == set(index.keys())  # together they read the checkpoint once
    for r in records:
        assert r["resident_bytes"] == r["planned_weight_bytes"]  # each rank holds exactly its stage's share
        assert r["bytes_read"] == sum(index[k].nbytes for k in r["keys_read"])


def test_a_model_too_big_for_one_rank_runs_across_two(tiny_llama, tmp_path):
    one_host = plan(tiny_llama, max_memory={"cpu": "1GiB"}, context=64, batch_size=2).budget("cpu").total
    budget = str(int(one_host * 0.8))
    with pytest.raises(PlanError, match="does not fit"):
        plan(tiny_llama, max_memory={"cpu": budget}, context=64, batch_size=2)
    assert [
        s.num_layers
        for s in plan_cluster(tiny_llama, [PlanInputs(max_memory={"cpu": budget})] * 2, context=64, batch_size=2).stages
    ] == [2, 2]
    job = {"model": str(tiny_llama), "prompts": PROMPTS[:2], "max_new_tokens": 4, "out": str(tmp_path)}
    job["host_memory"] = budget
    records = run_ranks(2, job, _port())
    assert records[0]["tokens"] == _reference(tiny_llama, PROMPTS[:2], 4)


def test_micro_batches_overlap_across_stages(tiny_llama, tmp_path):
    """Every stage sleeps ``d`` per micro-batch: a step of m micro-batches over k stages takes about (m+k-1)·d."""
    d, m, k = 0.25, 4, 2
    job = {"model": str(tiny_llama), "prompts": [[5, 6, 7]] * m, "max_new_tokens": 1, "out": str(tmp_path)}
    job.update(micro_batches=m, delay_s=d, timed_steps=3)
    records = run_ranks(k, job, _port())
    steps = records[0]["step_seconds"]
    best = min(steps)
    assert best >= (m + k - 1) * d * 0.95, steps
    assert best < (m * k - 1) * d, f"a step took {best:.2f}s: stages did not overlap (sequential would be {m * k * d}s)"


def test_a_rank_that_planned_differently_is_refused(tiny_llama, tmp_path):
    job = {"model": str(tiny_llama), "prompts": PROMPTS[:2], "max_new_tokens": 2, "out": str(tmp_path)}
    job["context_skew"] = 64  # the last rank plans for another context
    records = run_ranks(2, job, _port())
    for r in records:
        assert "rank 1 was started with a different plan" in r["error"]


def test_a_killed_rank_fails_generation_and_rank_0_exits_non_zero_quickly(tiny_llama, tmp_path):
    """Rank 1 dies mid-generation: rank 0's next receive fails (connection closed, or the group timeout for a hung
    rank), it names the rank, and exits non-zero well within 30 s."""
    job = {"model": str(tiny_llama), "prompts": PROMPTS, "max_new_tokens": 400, "out": str(tmp_path)}
    job.update(delay_s=0.02, kill_rank=1, kill_after_s=3.0, timeout_s=20)
    records = run_ranks(2, job, _port())
    assert records[1]["exitcode"] == 9
    assert records[0]["exitcode"] not in (0, None)
    assert re.search(r"pipeline rank 1 stopped (answering|receiving)", records[0]["broken"]), records[0]
    assert records[0]["seconds"] < 30
