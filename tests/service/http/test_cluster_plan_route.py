"""POST /plan with a ``hosts`` list against a real server: the ClusterPlan JSON, equal to the cluster planner's, and
a clear 4xx for every bad hosts list."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from planner.cluster import ClusterPlan, plan_cluster
from planner.placement.inputs import PlanInputs


def test_hosts_list_answers_the_cluster_plan(client: httpx.Client, tiny_llama: Path) -> None:
    hosts = [{"max_memory": {"cpu": "64MiB"}}, {"gpus": "1x32MiB", "max_memory": {"cpu": "64MiB"}}]
    body = {"hosts": hosts, "batch_size": 4, "context": 128, "micro_batches": 2, "inter_host_bandwidth": "100Gb"}
    r = client.post("/plan", json=body)
    assert r.status_code == 200, r.text
    got = ClusterPlan.from_dict(r.json())
    want = plan_cluster(
        str(tiny_llama),
        [PlanInputs(max_memory={"cpu": "64MiB"}), PlanInputs(gpus="1x32MiB", max_memory={"cpu": "64MiB"})],
        batch_size=4,
        context=128,
        micro_batches=2,
        inter_host_bandwidth=12.5e9,
    )
    assert got.to_dict() == want.to_dict()
    assert [s.host for s in got.stages] == [0, 1] and len(got.hops) == 2
    assert {b.device for b in got.stages[1].plan.budgets} >= {0}  # the second host's own GPU is used
    assert got.inter_host_bandwidth == 12.5e9 and got.micro_batches == 2


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"hosts": []}, 422, "hosts"),
        ({"hosts": [{"max_memory": {"cpu": "1GiB"}, "disk": "1TB"}]}, 422, "disk"),
        ({"hosts": [{"max_memory": {"cpu": "lots"}}]}, 422, "lots"),
        ({"hosts": [{"max_memory": {"cpu": "1GiB"}}], "max_memory": {"cpu": "1GiB"}}, 422, "each host its own"),
        ({"hosts": [{"max_memory": {"cpu": "1GiB"}}], "what_if": "max_batch"}, 422, "what_if"),
        ({"hosts": [{"max_memory": {"cpu": "1GiB"}}], "strategy": {"model": "cpu"}}, 422, "strategy name"),
        ({"hosts": [{"max_memory": {"cpu": "1GiB"}}], "inter_host_bandwidth": "fast"}, 422, "inter-host-bandwidth"),
        ({"hosts": [{"max_memory": {"cpu": "1GiB"}}], "inter_host_bandwidth": -1}, 422, "bandwidth"),
        ({"hosts": [{"max_memory": {"cpu": "1KiB"}}] * 2}, 422, "does not fit on 2 host(s)"),
        ({"micro_batches": 2, "max_memory": {"cpu": "1GiB"}}, 422, "give a hosts list"),
        ({"hosts": [{"max_memory": {"cpu": "1GiB"}}] * 65}, 422, "hosts"),
    ],
)
def test_a_bad_hosts_list_is_a_4xx_naming_what_is_wrong(client: httpx.Client, body, status, words) -> None:
    r = client.post("/plan", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]
