"""The GPU check (``bench/gpu_check.sh`` → ``bench/gpu_check.py`` → ``bench/gpu_stages.py``) on the CPU: the
driver's control flow with stages stubbed to fail in turn (and one that hangs), the whole script end to end in its
dry run (the CPU and a tiny model stand in), and a wrong weight caught by the correctness stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loaders
from bench import gpu_check, gpu_stages

ROOT = Path(__file__).resolve().parents[2]


def _fake_nvidia_smi(tmp_path: Path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 550.54.15, 81559, 0"\n')
    smi.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def _run_script(tmp_path: Path, *args: str, timeout: float = 120, **env: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    full_env = dict(
        os.environ,
        PATH=_fake_nvidia_smi(tmp_path),
        OUT=str(out),
        PYTHON=sys.executable,
        PYTHONPATH=str(ROOT),
        LOADMASTER_WHEELHOUSE=str(tmp_path / "no-wheelhouse"),
        LOADMASTER_GPU_CHECK_WORK=str(tmp_path / "work"),
        **env,
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    return proc.returncode, json.loads((out / "gpu_check.json").read_text()), proc.stdout + proc.stderr


def test_the_scripts_parse():
    for script in ("gpu_check.sh", "gpu_wheelhouse.sh"):
        assert subprocess.run(["bash", "-n", f"bench/{script}"], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("number,stage", list(enumerate([s for s, _ in gpu_check.STAGES], 1)))
def test_a_failing_stage_keeps_every_other_stage_and_names_itself_in_the_exit_status(tmp_path, number, stage):
    rc, result, log = _run_script(tmp_path, LOADMASTER_GPU_CHECK_STUB="1", LOADMASTER_GPU_CHECK_FAIL=stage)
    assert rc == 10 + number == result["exit"], log
    statuses = {s["stage"]: s["status"] for s in result["stages"]}
    assert statuses == {s: ("FAIL" if s == stage else "PASS") for s, _ in gpu_check.STAGES}
    failed = next(s for s in result["stages"] if s["stage"] == stage)
    # the line the stage wrote before it raised is kept, and the crash is a line of its own with the traceback's end
    assert [ln["status"] for ln in failed["lines"]] == ["PASS", "FAIL"]
    assert "stubbed to fail" in failed["lines"][-1]["detail"]
    assert f"FAIL {stage}/crashed" in log


def test_a_stage_that_overruns_is_killed_and_the_next_ones_run(tmp_path):
    rc, result, log = _run_script(
        tmp_path, "--scale", "0.05", LOADMASTER_GPU_CHECK_STUB="1", LOADMASTER_GPU_CHECK_HANG="memory"
    )
    assert rc == 15, log
    memory = next(s for s in result["stages"] if s["stage"] == "memory")
    assert memory["lines"][-1]["name"] == "timeout" and memory["seconds"] < 10
    assert [s["status"] for s in result["stages"]][5:] == ["PASS", "PASS", "PASS"]
    jsonl = (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()
    assert len(jsonl) == sum(len(s["lines"]) for s in result["stages"])


@pytest.mark.slow
def test_the_dry_run_passes_end_to_end(tmp_path):
    """Every stage's real code on the CPU with a tiny model: what only a GPU shows is a SKIP line, nothing FAILs."""
    rc, result, log = _run_script(tmp_path, "--scale", "4", "--budget", "1500", timeout=1600)
    assert rc == 0, log
    assert [s["stage"] for s in result["stages"]] == [s for s, _ in gpu_check.STAGES]
    lines = [ln for s in result["stages"] for ln in s["lines"]]
    assert not [ln for ln in lines if ln["status"] == "FAIL"], log
    names = {ln["name"] for ln in lines if ln["status"] == "PASS"}
    assert {"transformers version", "fp32 (TF32 off) logits vs the CPU reference"} <= names
    assert any(n.startswith("serve (loadmaster") for n in names), names
    assert any(n.startswith("oom: the next request") for n in names), names


@pytest.mark.slow
def test_a_wrong_weight_fails_the_correctness_stage(tmp_path, monkeypatch):
    """One weight off by 1e-2: the greedy tokens, the byte comparison and the fp32 logits all FAIL."""
    load = loaders.load_model

    def off_by_a_little(*args, **kwargs):
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.add_(1e-2)
        return model

    monkeypatch.setattr(loaders, "load_model", off_by_a_little)
    lines = []
    ctx = {"dry": True, "work": str(tmp_path), "tokens": 8}
    gpu_stages.stage_correctness(ctx, lambda name, status, detail, **_: lines.append((name, status)))
    status = dict(lines)
    assert status["byte-exact parameters on GPU 0"] == "FAIL"
    assert status["fp32 (TF32 off) logits vs the CPU reference"] == "FAIL"
