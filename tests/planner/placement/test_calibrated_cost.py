"""The calibrated inputs of the cost model move its prediction the way the machine would: a slower kernel, a dearer
call, layer or disk layer each lower the predicted tokens/s by what the cost model's line says. No timing here: the
calibrations are written by hand, and the fit is checked on made-up points."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import planner
from planner.hardware.calibration import (
    Calibration,
    CallPoint,
    KernelRate,
    fit_calls,
    load_calibration,
    machine_id,
    save_calibration,
)

LAYERS = 4  # the tiny Llama's decoder layers
KWARGS = dict(max_memory={"cpu": "1GiB", "disk": "1GiB"}, dtype="float32", context=64, batch_size=1)


def _cal(**kw: object) -> Calibration:
    base = Calibration(
        machine=machine_id(),
        created="2026-01-01T00:00:00Z",
        threads=1,
        memory_read=2.0e10,
        disk_cold=1.0e9,
        disk_warm=5.0e9,
        kernels={"float32": KernelRate("float32", "native", 2.0e10, 2.0e10, call_overhead=0.0)},
        layer_overhead=0.001,
        step_overhead=0.002,
    )
    return replace(base, **kw)


def _half_on_disk() -> dict[str, str]:
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": "cpu" if i < LAYERS // 2 else "disk" for i in range(LAYERS)})
    return dm


@pytest.fixture
def predict(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Save ``cal`` as this machine's calibration and plan the tiny Llama with it (``strategy``: a device map)."""
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("LOADMASTER_CALIBRATION", str(path))
    stamp = iter(range(1, 10_000))

    def run(cal: Calibration, strategy: str | dict = "sequential"):
        # a new file each time (the loader caches by modification time, which may not tick between two saves)
        path.unlink(missing_ok=True)
        save_calibration(replace(cal, created=f"2026-01-01T00:00:{next(stamp):02d}Z"), path)
        return planner.plan(str(tiny_llama), strategy=strategy, **KWARGS).prediction

    return run


def test_overheads_add_per_step_per_layer_per_disk_layer_and_per_head_call(predict) -> None:
    base = predict(_cal())
    assert base.seconds_per_token_by_device["overhead"] == pytest.approx(0.002 + LAYERS * 0.001)

    dear_calls = predict(_cal(kernels={"float32": KernelRate("float32", "native", 2.0e10, 2.0e10, 0.0005)}))
    assert dear_calls.seconds_per_token_by_device["overhead"] == pytest.approx(0.002 + LAYERS * 0.001 + 0.0005), (
        "the head is the one linear call outside the layers"
    )
    assert dear_calls.decode_tokens_per_s < base.decode_tokens_per_s

    dear_layers = predict(_cal(layer_overhead=0.003))
    assert dear_layers.seconds_per_token_by_device["overhead"] == pytest.approx(0.002 + LAYERS * 0.003)
    assert dear_layers.decode_tokens_per_s < base.decode_tokens_per_s

    resident_disk_cost = predict(_cal(disk_layer_overhead=0.004))
    assert resident_disk_cost.seconds_per_token_by_device["overhead"] == pytest.approx(
        base.seconds_per_token_by_device["overhead"]
    ), "a disk layer's extra cost is not charged to a model with no layer on disk"

    half = predict(_cal(disk_layer_overhead=0.004), _half_on_disk())
    assert half.seconds_per_token_by_device["overhead"] == pytest.approx(0.002 + LAYERS * 0.001 + 2 * 0.004)
    assert half.decode_tokens_per_s < base.decode_tokens_per_s
    assert "+4.000 on disk" in half.cost_model


def test_slower_kernel_rates_slow_the_blocks_they_read(predict) -> None:
    fast = predict(_cal(), _half_on_disk())
    slow_resident = predict(_cal(kernels={"float32": KernelRate("float32", "native", 0.5e10, 2.0e10)}), _half_on_disk())
    assert slow_resident.seconds_per_token_by_device["cpu"] > 2 * fast.seconds_per_token_by_device["cpu"]
    assert slow_resident.seconds_per_token_by_device["disk"] == pytest.approx(
        4 * fast.seconds_per_token_by_device["disk"], rel=0.05
    ), "a mapped rate above the resident one is capped: a warm disk block never reads faster than the same RAM"

    slow_mapped = predict(_cal(kernels={"float32": KernelRate("float32", "native", 2.0e10, 0.5e10)}), _half_on_disk())
    assert slow_mapped.seconds_per_token_by_device["disk"] > 2 * fast.seconds_per_token_by_device["disk"]
    assert slow_mapped.decode_tokens_per_s < fast.decode_tokens_per_s


def test_a_dtype_not_calibrated_pays_no_call_cost(predict) -> None:
    cal = _cal(kernels={"bfloat16": KernelRate("bfloat16", "native", 1.0e9, 1.0e9, 0.01)})
    pred = predict(cal)
    assert pred.seconds_per_token_by_device["overhead"] == pytest.approx(0.002 + LAYERS * 0.001)


def test_the_fit_recovers_rate_fixed_cost_and_row_cost_and_survives_noise() -> None:
    rate, fixed, per_row = 8.0e9, 40e-6, 60e-9
    sizes = [1 << 18, 1 << 20, 4 << 20, 16 << 20, 32 << 20]

    def point(nbytes: int, width: int) -> CallPoint:
        rows = nbytes // (width * 4)
        return CallPoint(nbytes, rows, fixed + rows * per_row + nbytes / rate)

    fit = fit_calls([point(b, w) for w in (512, 4096) for b in sizes])
    assert fit.rate == pytest.approx(rate, rel=1e-6) and fit.overhead == pytest.approx(fixed, rel=1e-6)
    assert fit.row_overhead == pytest.approx(per_row, rel=1e-6)

    # one width: rows and bytes move together, so the row cost cannot be told apart and is folded into the rate
    one_width = fit_calls([point(b, 2048) for b in sizes])
    assert one_width.row_overhead == 0.0 and one_width.overhead == pytest.approx(fixed, rel=1e-6)
    assert one_width.rate < rate

    # smaller calls that came out cheaper than their bytes allow (noise): no negative fixed cost, the big rate kept
    fit = fit_calls([CallPoint(1 << 20, 256, 1e-6), CallPoint(32 << 20, 8192, (32 << 20) / rate)])
    assert fit.overhead == 0.0 and fit.row_overhead == 0.0 and fit.rate == pytest.approx(rate)


def test_each_matrix_row_costs_the_calibrated_row_overhead(predict, tiny_llama: Path) -> None:
    """The tiny Llama's matrices have a known number of output rows; each costs the fitted cost per row, on top of
    the per-layer and per-step figures (embedding lookups read one row, and pay none)."""
    cfg = json.loads((tiny_llama / "config.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    rows = LAYERS * (h + kv + kv + h + i + i + h) + v  # seven projections per layer, and the head
    base = predict(_cal())
    per_row = 1e-6
    dear_rows = predict(
        _cal(kernels={"float32": KernelRate("float32", "native", 2.0e10, 2.0e10, row_overhead=per_row)})
    )
    extra = dear_rows.seconds_per_token_by_device["overhead"] - base.seconds_per_token_by_device["overhead"]
    assert extra == pytest.approx(rows * per_row, rel=1e-6)
    assert dear_rows.decode_tokens_per_s < base.decode_tokens_per_s
    assert "1000 ns/matrix row" in dear_rows.cost_model


def test_a_calibration_of_the_older_format_is_ignored_with_advice(tmp_path: Path, caplog) -> None:
    path = tmp_path / "calibration.json"
    old = _cal().to_dict()
    old["version"] = 1
    path.write_text(json.dumps(old))
    assert load_calibration(path) is None
    assert "format version 1" in caplog.text and "loadmaster env --calibrate" in caplog.text
