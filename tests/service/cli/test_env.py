"""``loadmaster env`` (table and ``--json``), the calibration record, and the planner's use of a calibration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import planner
from planner.hardware.calibration import Calibration, KernelRate, load_calibration, machine_id, save_calibration
from service.cli import env_report

ROOT = Path(__file__).resolve().parents[3]
SECRET = "sk-very-secret-1"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full,
        timeout=300,
    )


def test_env_json_parses_and_masks_secrets(tmp_path: Path) -> None:
    proc = _cli(
        "env",
        "--json",
        "--offload-folder",
        str(tmp_path),
        env={"LOADMASTER_API_KEY": f"{SECRET},other-key", "LOADMASTER_MAX_BATCH_SIZE": "8"},
    )
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["settings"]["LOADMASTER_API_KEY"] == "***,*** (2 set)"
    assert report["settings"]["LOADMASTER_MAX_BATCH_SIZE"] == "8"
    assert (
        report["versions"]["torch"] == torch.__version__.split("+")[0]
        or report["versions"]["torch"] == torch.__version__
    )
    assert report["versions"]["loadmaster"] and report["versions"]["safetensors"]
    assert report["gpus"] == [] if not torch.cuda.is_available() else len(report["gpus"]) == torch.cuda.device_count()
    assert report["cuda"] == torch.version.cuda
    from loaders.native import kernel_build

    st = kernel_build.status()
    assert report["kernel_path"] == (st.isa if st.available else None)
    assert {k["weights"]: k["available"] for k in report["kernels"]} == {
        **{str(d).removeprefix("torch."): st.available for d in kernel_build.KERNELS},
        **{q: st.available for q in kernel_build.QUANT_KERNELS},
    }
    flags = kernel_build.cpu_flags()
    for isa in report["kernel_isas"]:
        needed = list(kernel_build.ISAS[isa["name"]].cpu_flags)
        assert isa["cpu_flags_needed"] == needed
        assert isa["cpu_flags_missing"] == [f for f in needed if f not in flags]
        assert isa["runnable"] == (isa["name"] in kernel_build.runnable_isas())
    assert report["cpu_cores"] == os.cpu_count() and report["cpu_model"]
    assert report["ram_total_bytes"] > report["ram_available_bytes"] > 0
    assert report["disk_free_bytes"] > 0 and report["offload_folder"] == str(tmp_path)
    assert isinstance(report["bitsandbytes_works"], bool) and report["bitsandbytes_detail"]
    assert report["calibration"] == {"path": None, "present": False, "summary": None}  # tests run with it off


def test_env_table_names_everything_a_bug_report_needs(tmp_path: Path) -> None:
    report = env_report.collect(tmp_path, environ={"LOADMASTER_API_KEY": SECRET, "LOADMASTER_CALIBRATION": "off"})
    text = env_report.format_report(report)
    for needle in (
        "loadmaster",
        "python",
        "torch",
        "transformers",
        "safetensors",
        "bitsandbytes",
        "CUDA",
        "GPUs",
        "CPU",
        "cores",
        "instruction sets",
        "kernel path avx2",
        "native kernels",
        "kernel bfloat16",
        "kernel float32",
        "kernel int8",
        "RAM",
        "disk free",
        "bitsandbytes works",
        "calibration",
        "LOADMASTER_API_KEY",
    ):
        assert needle in text, needle
    assert SECRET not in text


def test_calibrate_refuses_when_calibration_is_off() -> None:
    proc = _cli("env", "--calibrate", env={"LOADMASTER_CALIBRATION": "off"})
    assert proc.returncode == 2 and "LOADMASTER_CALIBRATION=off" in proc.stderr


def _calibration(**kw: object) -> Calibration:
    base = Calibration(
        machine=machine_id(),
        created="2026-01-01T00:00:00Z",
        threads=2,
        memory_read=2.0e10,
        disk_cold=1.0e9,
        disk_warm=5.0e9,
        kernels={"float32": KernelRate("float32", "native", 2.0e10, 1.0e10)},
        layer_overhead=0.001,
        step_overhead=0.002,
    )
    return replace(base, **kw)


def test_calibration_saves_atomically_and_loads_back(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "calibration.json"
    cal = _calibration()
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"], "no temporary file is left behind"


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: "{not json",
        lambda d: json.dumps({**d, "version": 99}),
        lambda d: json.dumps({**d, "memory_read": -5}),
        lambda d: json.dumps({**d, "kernels": {"float32": {"path": "magic", "resident": 1e9, "mapped": 1e9}}}),
        lambda d: json.dumps({**d, "layer_overhead": "fast"}),
        lambda d: json.dumps({**d, "machine": "another CPU x64"}),
    ],
)
def test_invalid_or_foreign_calibrations_are_ignored(tmp_path: Path, damage, caplog) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(damage(_calibration().to_dict()))
    assert load_calibration(path) is None
    assert "ignoring calibration" in caplog.text


def test_planner_predicts_with_the_calibration_and_says_so(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs = dict(max_memory={"cpu": "1GiB"}, dtype="float32", context=64)
    default = planner.plan(str(tiny_llama), **kwargs).prediction
    assert "calibrated" not in default.cost_model
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("LOADMASTER_CALIBRATION", str(path))

    # Same rates as the defaults: the only change is the measured overhead, 2 ms per step + 1 ms per layer.
    save_calibration(_calibration(), path)
    same = planner.plan(str(tiny_llama), **kwargs).prediction
    assert "calibrated on this machine" in same.cost_model and str(path) in same.cost_model
    assert same.seconds_per_token_by_device["cpu"] == pytest.approx(
        default.seconds_per_token_by_device["cpu"], abs=1e-6
    )
    assert same.seconds_per_token_by_device["overhead"] == pytest.approx(0.002 + 4 * 0.001)
    assert same.decode_tokens_per_s == pytest.approx(1 / sum(same.seconds_per_token_by_device.values()), rel=1e-3)

    # A kernel half as fast as memory: the weights' share of the step doubles (the KV cache reads at memory rate).
    save_calibration(
        _calibration(
            kernels={"float32": KernelRate("float32", "native", 1.0e10, 1.0e10)}, created="2026-01-02T00:00:00Z"
        ),
        path,
    )
    slow = planner.plan(str(tiny_llama), **kwargs).prediction
    assert slow.seconds_per_token_by_device["cpu"] > 1.5 * default.seconds_per_token_by_device["cpu"]
    assert slow.decode_tokens_per_s < same.decode_tokens_per_s

    # A rate the caller sets wins over the calibration.
    forced = planner.plan(str(tiny_llama), bandwidths={"cpu": 5.0e10}, **kwargs).prediction
    # (per-device seconds are rounded to the microsecond, and the tiny model's are tens of microseconds)
    assert forced.seconds_per_token_by_device["cpu"] == pytest.approx(
        default.seconds_per_token_by_device["cpu"] * 0.4, abs=1.5e-6
    )
    assert forced.seconds_per_token_by_device["overhead"] == pytest.approx(0.006), (
        "the overhead is still this machine's"
    )


def test_calibration_measures_this_machine(tmp_path: Path) -> None:
    """A small calibration end to end: every figure measured, positive, and accepted by the validator."""
    from service.cli.calibrate import calibrate

    cal = calibrate(tmp_path, size=32 << 20, say=lambda m: None)
    assert Calibration.from_dict(cal.to_dict()) == cal
    assert cal.machine == machine_id() and cal.memory_read > 1e8 and cal.disk_warm > 1e7 and cal.disk_cold > 1e6
    assert set(cal.kernels) == {"float32", "bfloat16"}
    assert all(k.resident > 1e8 and k.mapped > 1e8 for k in cal.kernels.values())
    assert all(k.extra_row_cost is not None and 0 <= k.extra_row_cost < 10 for k in cal.kernels.values())
    assert cal.link is None or torch.cuda.is_available()
    assert list(tmp_path.iterdir()) == [], "scratch files are removed"
