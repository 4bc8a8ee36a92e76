"""A pipeline stage loads into host memory: a stage plan that places blocks on a GPU or on disk is refused with a
message saying what to plan instead, rather than loaded to the CPU against the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from loaders.errors import CheckpointError
from loaders.pipeline_stage import load_stage
from planner.cluster import plan_cluster
from planner.inputs import PlanInputs


def test_a_stage_planned_onto_a_gpu_is_refused_naming_the_device(tiny_llama: Path) -> None:
    host = PlanInputs(gpus="1x4GiB", max_memory={"cpu": "1GiB"})
    plan = plan_cluster(tiny_llama, [host] * 2, context=64)
    assert 0 in set(plan.stages[1].plan.device_map.values())
    with pytest.raises(CheckpointError, match=r"stage 1's plan places blocks on device\(s\) 0.*--max-memory cpu"):
        load_stage(tiny_llama, plan, 1)


def test_a_stage_planned_for_host_memory_loads_its_planned_weights(tiny_llama: Path) -> None:
    plan = plan_cluster(tiny_llama, [PlanInputs(max_memory={"cpu": "1GiB"})] * 2, context=64)
    stage = load_stage(tiny_llama, plan, 1)
    assert stage.resident_bytes == sum(b.weights for b in plan.stages[1].plan.budgets)
