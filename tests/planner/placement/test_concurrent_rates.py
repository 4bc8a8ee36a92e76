"""A plan states the aggregate decode rate of several sequences at once (``prediction.concurrent``): the weights are
read once per step for all of them, the KV cache per sequence, and without GPUs the CPU's arithmetic grows per row
(:func:`planner.placement.cost_model.extra_row_cost`). The expected figures are worked out here from the plan's own
per-device seconds, so a change to any of the three terms fails a test."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.api import plan
from planner.hardware.calibration import Calibration, KernelRate, machine_id, save_calibration
from planner.hardware.device_inventory import DEFAULT_BANDWIDTHS
from planner.placement.cost_model import CONCURRENCY, CONCURRENT_CONTEXT, EXTRA_ROW_COST, extra_row_cost
from planner.types import Plan, Workload

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "configs" / "llama-3-8b.json"
CONTEXT = 2048


def _kv_seconds_of_one_sequence(p: Plan) -> float:
    """The plan's KV cache of one full-context sequence, read from host RAM (batch 1: the plan's whole KV)."""
    return sum(b.kv_cache for b in p.budgets) / p.workload.batch_size / DEFAULT_BANDWIDTHS["cpu"]


def _expected(p: Plan, sequences: int, row_cost: float) -> float:
    """``sequences`` of :data:`CONCURRENT_CONTEXT` tokens: the CPU's weight seconds grown per row, the disk's not,
    their KV read per token held; the larger of disk and the rest where a cold disk tier is read ahead."""
    seconds = dict(p.prediction.seconds_per_token_by_device)
    kv_one = _kv_seconds_of_one_sequence(p)
    cpu_weights = seconds.pop("cpu") - kv_one
    disk = seconds.pop("disk", 0.0)
    rest = cpu_weights * (1 + row_cost * (sequences - 1)) + kv_one * sequences * CONCURRENT_CONTEXT / CONTEXT
    overlapped = "disk" in p.prediction.seconds_per_token_by_device and p.offloaded_bytes > 0
    step = max(disk, rest) if overlapped else disk + rest
    return sequences / step


def test_a_resident_cpu_plan_grows_each_rows_arithmetic() -> None:
    p = plan(str(CONFIG), max_memory={"cpu": "64GiB"}, dtype="bfloat16", context=CONTEXT)
    assert [c.sequences for c in p.prediction.concurrent] == list(CONCURRENCY)
    for c in p.prediction.concurrent:
        assert c.tokens_per_s == pytest.approx(_expected(p, c.sequences, EXTRA_ROW_COST["bfloat16"]), rel=2e-3)
    lone, sixteen = p.prediction.decode_tokens_per_s, p.prediction.concurrent_rate(16)
    assert sixteen is not None and 8 * lone < sixteen < 16 * lone, "16 rows cost more than one, far less than 16"


def test_a_cold_disk_tier_does_not_grow_with_the_rows() -> None:
    """In a 6 GiB box the 8B streams most of itself: 16 rows still read the disk once, so they gain almost 16x."""
    p = plan(str(CONFIG), max_memory={"cpu": "6GiB", "disk": "100GiB"}, dtype="bfloat16", context=CONTEXT)
    assert p.prediction.seconds_per_token_by_device["disk"] > 0
    for c in p.prediction.concurrent:
        assert c.tokens_per_s == pytest.approx(_expected(p, c.sequences, EXTRA_ROW_COST["bfloat16"]), rel=2e-3)
    assert p.prediction.concurrent_rate(16) > 15 * p.prediction.decode_tokens_per_s


def test_gpu_products_are_taken_as_memory_bound_at_any_batch() -> None:
    p = plan(str(CONFIG), max_memory={0: "80GiB", "cpu": "64GiB"}, dtype="bfloat16", context=CONTEXT)
    step = sum(p.prediction.seconds_per_token_by_device.values())
    kv_one = sum(b.kv_cache for b in p.budgets) / DEFAULT_BANDWIDTHS["gpu"]
    for c in p.prediction.concurrent:
        want = c.sequences / (step - kv_one + kv_one * c.sequences * CONCURRENT_CONTEXT / CONTEXT)
        assert c.tokens_per_s == pytest.approx(want, rel=2e-3)


def test_the_rates_survive_the_plans_json() -> None:
    p = plan(str(CONFIG), max_memory={"cpu": "6GiB", "disk": "100GiB"}, dtype="bfloat16", context=CONTEXT)
    again = Plan.from_dict(json.loads(p.to_json()))
    assert again.prediction.concurrent == p.prediction.concurrent and again.prediction.concurrent
    older = json.loads(p.to_json())
    del older["prediction"]["concurrent"]  # a plan saved before the rates existed still reads
    assert Plan.from_dict(older).prediction.concurrent == []


def test_the_row_cost_is_the_kernels_and_a_calibration_measures_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp32, int4 = Workload(dtype="float32"), Workload(dtype="float32", cpu_quantization="int4")
    monkeypatch.setenv("LOADMASTER_CALIBRATION", "off")
    assert extra_row_cost(fp32) == EXTRA_ROW_COST["float32"]
    assert extra_row_cost(int4) == EXTRA_ROW_COST["int4"] > EXTRA_ROW_COST["float32"]
    assert extra_row_cost(Workload(dtype="float16")) == EXTRA_ROW_COST["float32"], "not measured: the fp32 figure"

    cal = Calibration(
        machine=machine_id(),
        created="2026-01-01T00:00:00Z",
        threads=2,
        memory_read=2.0e10,
        disk_cold=1.0e9,
        disk_warm=5.0e9,
        kernels={"float32": KernelRate("float32", "native", 2.0e10, 2.0e10, extra_row_cost=0.125)},
        layer_overhead=0.0,
        step_overhead=0.0,
    )
    path = save_calibration(cal, tmp_path / "calibration.json")
    monkeypatch.setenv("LOADMASTER_CALIBRATION", str(path))
    assert extra_row_cost(fp32) == 0.125
    assert extra_row_cost(int4) == EXTRA_ROW_COST["int4"], "the calibration measured float kernels only"
    bad = replace(cal, kernels={"float32": replace(cal.kernels["float32"], extra_row_cost=-1.0)}).to_dict()
    with pytest.raises(ValueError, match=r"kernels\.float32\.extra_row_cost"):
        Calibration.from_dict(bad)
    old = cal.to_dict()
    del old["kernels"]["float32"]["extra_row_cost"]
    assert Calibration.from_dict(old).extra_row_cost("float32") is None
