"""Cluster planning: one contiguous run of layers per host, each placed within its host, a pipeline prediction."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from planner import plan
from planner.cluster import ClusterPlan, plan_cluster
from planner.errors import PlanError
from planner.placement.inputs import PlanInputs
from planner.placement.sizing import size_blocks
from planner.types import Workload
from tests.planner.synthetic import llama_like

ROOT = Path(__file__).resolve().parents[2]


def _hosts(n: int, **kw) -> list[PlanInputs]:
    return [PlanInputs(**kw) for _ in range(n)]


def test_every_block_is_on_exactly_one_stage_and_layers_are_contiguous():
    sk = llama_like(layers=9)
    cp = plan_cluster(sk, _hosts(3, max_memory={"cpu": "1GiB"}), batch_size=6, context=64)
    layer_names = [b.name for b in sk.blocks if b.layer_index is not None]
    held = [name for st in cp.stages for name in st.blocks if name != "model.rotary_emb"]
    assert sorted(held) == sorted(b.name for b in sk.blocks if b.name != "model.rotary_emb")
    assert [st.num_layers for st in cp.stages] == [3, 3, 3]
    runs = [[n for n in st.blocks if n in layer_names] for st in cp.stages]
    assert sum(runs, []) == layer_names  # stage order is layer order
    # The ring: embeddings and head with stage 0; buffer-only blocks on every stage.
    assert {"model.embed_tokens", "lm_head", "model.norm"} <= set(cp.stages[0].blocks)
    assert all("model.rotary_emb" in st.blocks for st in cp.stages)
    assert [(h.source, h.target) for h in cp.hops] == [(0, 1), (1, 2), (2, 0)]


def test_a_model_too_big_for_one_host_splits_over_two():
    sk = llama_like(layers=8, hidden=512, intermediate=1376)
    weights = sum(b.weight for b in size_blocks(sk, Workload("float32", None, 1, 64)))
    host = {"cpu": int(weights * 0.7)}
    with pytest.raises(PlanError):
        plan(sk, max_memory=host, context=64)
    cp = plan_cluster(sk, _hosts(2, max_memory=host), context=64)
    for st in cp.stages:
        b = st.plan.budget("cpu")
        assert b is not None and b.total + st.boundary_bytes <= host["cpu"]
    with pytest.raises(PlanError, match="does not fit on 1 host"):
        plan_cluster(sk, _hosts(1, max_memory=host), context=64)


def test_layers_follow_host_memory_and_move_off_a_host_that_is_full():
    sk = llama_like(layers=8)
    big, small = PlanInputs(max_memory={"cpu": "3GiB"}), PlanInputs(max_memory={"cpu": "1GiB"})
    cp = plan_cluster(sk, [big, small], context=64)
    assert [st.num_layers for st in cp.stages] == [6, 2]
    # A host with room for only a couple of layers keeps what fits; the rest moves to its neighbour.
    per_layer = size_blocks(sk, Workload("float32", None, 1, 64))[1]
    tight = PlanInputs(max_memory={"cpu": per_layer.weight * 2 + per_layer.kv * 2 + 2_000_000})
    cp = plan_cluster(sk, [PlanInputs(max_memory={"cpu": "1GiB"}), tight], context=64)
    assert cp.stages[1].num_layers < 4
    assert sum(st.num_layers for st in cp.stages) == 8


def test_prediction_is_slowest_stage_plus_hop_when_the_pipeline_is_full():
    sk = llama_like(layers=8)
    cp = plan_cluster(sk, _hosts(2, max_memory={"cpu": "1GiB"}), batch_size=8, micro_batches=4, context=64)
    slow = max(st.seconds_per_micro_batch for st in cp.stages)
    hop = max(h.seconds for h in cp.hops)
    assert cp.micro_batch_size == 2
    assert cp.prediction.step_seconds == pytest.approx(4 * (slow + hop), rel=1e-6)
    assert cp.prediction.decode_tokens_per_s == pytest.approx(8 / cp.prediction.step_seconds, rel=1e-3)
    # A slower link makes the hop, and so the step, longer; hidden states of one micro-batch cross it.
    slow_link = plan_cluster(
        sk, _hosts(2, max_memory={"cpu": "1GiB"}), batch_size=8, micro_batches=4, context=64, inter_host_bandwidth=1e6
    )
    assert slow_link.hops[0].decode_bytes == 2 * 256 * 4
    assert slow_link.prediction.step_seconds > cp.prediction.step_seconds
    # One micro-batch cannot fill two stages: the trip around the ring bounds the step.
    one = plan_cluster(sk, _hosts(2, max_memory={"cpu": "1GiB"}), batch_size=1, context=64)
    total = sum(st.seconds_per_micro_batch for st in one.stages) + sum(h.seconds for h in one.hops)
    assert one.prediction.step_seconds == pytest.approx(total, rel=1e-6)
    assert "ring" in one.prediction.bottleneck


def test_gpu_hosts_place_their_stage_within_the_host():
    sk = llama_like(layers=8)
    hosts = _hosts(2, gpus="2x1GiB", max_memory={"cpu": "1GiB"}, gpu_reserve=0)
    cp = plan_cluster(sk, hosts, context=64, strategy="balanced")
    for st in cp.stages:
        layers = [st.plan.placement[f"model.layers.{i}"] for i in range(st.first_layer, st.last_layer + 1)]
        assert layers == sorted(layers) and set(layers) == {0, 1}  # each host spreads its run over its two GPUs


def test_json_round_trip_and_digest():
    cp = plan_cluster(llama_like(tied=True), _hosts(2, max_memory={"cpu": "1GiB"}), batch_size=2, context=64)
    again = ClusterPlan.from_json(cp.to_json())
    assert again == cp and again.digest() == cp.digest()
    other = plan_cluster(llama_like(tied=True), _hosts(2, max_memory={"cpu": "1GiB"}), batch_size=2, context=128)
    assert other.digest() != cp.digest()
    # The tied head stays with the embedding it shares weights with.
    assert "lm_head" in cp.stages[0].blocks and "model.embed_tokens" in cp.stages[0].blocks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 0}, "micro_batches"),
        ({"inter_host_bandwidth": -1}, "inter-host bandwidth"),
        ({"strategy": {"model": "cpu"}}, "strategy name"),
    ],
)
def test_bad_cluster_inputs_say_what_to_do(kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan_cluster(llama_like(), _hosts(2, max_memory={"cpu": "1GiB"}), **kwargs)


def test_more_hosts_than_layers_is_refused():
    with pytest.raises(PlanError, match="fewer than the 3 hosts"):
        plan_cluster(llama_like(layers=2), _hosts(3, max_memory={"cpu": "1GiB"}))


def test_cluster_planning_imports_no_torch():
    code = (
        "import sys\n"
        "from planner.cluster import plan_cluster\n"
        "from planner.placement.inputs import PlanInputs\n"
        "from tests.planner.synthetic import llama_like\n"
        "plan_cluster(llama_like(), [PlanInputs(max_memory={'cpu': '1GiB'})] * 2)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
