"""A pipeline stage loads through the ordinary loader (placement, then execution), restricted to its own tensors:
its blocks land where its stage plan says (disk included), a stage planned onto a GPU takes the one-host GPU path
(here, without CUDA, refused by that path's own message), and CPU quantization is the plan's."""

from __future__ import annotations

from pathlib import Path

import pytest

from loaders.load import load_stage
from planner.cluster import plan_cluster
from planner.errors import PlanError
from planner.placement.inputs import PlanInputs


def test_a_stage_planned_onto_a_gpu_takes_the_one_host_gpu_path(tiny_llama: Path) -> None:
    host = PlanInputs(gpus="1x4GiB", max_memory={"cpu": "1GiB"})
    plan = plan_cluster(tiny_llama, [host] * 2, context=64)
    assert 0 in set(plan.stages[1].plan.device_map.values())
    with pytest.raises(PlanError, match="places modules on a GPU but torch sees no CUDA device"):
        load_stage(tiny_llama, plan, 1)


def test_a_stage_planned_for_host_memory_loads_its_planned_weights(tiny_llama: Path) -> None:
    plan = plan_cluster(tiny_llama, [PlanInputs(max_memory={"cpu": "1GiB"})] * 2, context=64)
    stage = load_stage(tiny_llama, plan, 1)
    assert stage.resident_bytes == sum(b.weights for b in plan.stages[1].plan.budgets)
    assert all(k.startswith(("model.layers.2.", "model.layers.3.")) for k in stage.keys_read)


#: A CPU budget per host under which stage 0 (embeddings, head, two layers) puts part of itself on disk.
DISK_HOST = {"cpu": "760KiB", "disk": "1GiB"}


def test_a_stage_planned_partly_on_disk_keeps_those_blocks_on_disk(tiny_llama: Path, tmp_path: Path) -> None:
    host = PlanInputs(max_memory=DISK_HOST, offload_folder=str(tmp_path))
    plan = plan_cluster(tiny_llama, [host] * 2, context=64)
    assert {"cpu", "disk"} <= set(plan.stages[0].plan.device_map.values()), plan.stages[0].plan.device_map
    stage = load_stage(tiny_llama, plan, 0, offload_folder=tmp_path)
    planned = {b.device: b.weights for b in plan.stages[0].plan.budgets}
    assert stage.stats.bytes_per_device.get("disk", 0) > 0
    assert stage.resident_bytes == sum(w for d, w in planned.items() if d != "disk")
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.")) for k in stage.keys_read)


def test_cpu_quantization_must_be_the_plans(tiny_llama: Path) -> None:
    plan = plan_cluster(tiny_llama, [PlanInputs(max_memory={"cpu": "1GiB"})] * 2, context=64)
    with pytest.raises(
        PlanError, match=r"cpu_quantization='int8', but the pipeline was planned for cpu_quantization=None"
    ):
        load_stage(tiny_llama, plan, 1, cpu_quantization="int8")
