"""GPU detection fails loudly (issue 14 item 10): a machine that shows an NVIDIA driver, while torch cannot
use it, must not get a silent CPU-and-disk plan. The evidence (device nodes, ``nvidia-smi``) is faked in a tmp
dir; torch is the real, CPU-only one installed here, so its real failure is what the error reports."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from planner.api import plan
from planner.errors import PlanError
from planner.hardware.device_inventory import HostPaths, build_hardware, detect_gpus
from tests.planner.synthetic import llama_like

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="proves the CPU-only torch's failure path")


def _paths(tmp_path: Path, *, dev_nodes=(), smi=False, visible=None) -> HostPaths:
    dev, bin_dir = tmp_path / "dev", tmp_path / "bin"
    dev.mkdir()
    bin_dir.mkdir()
    for node in dev_nodes:
        (dev / node).write_text("")
    if smi:
        exe = bin_dir / "nvidia-smi"
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "meminfo").write_text(f"MemAvailable: {16 * 2**20} kB\n")
    return HostPaths(
        meminfo=str(tmp_path / "meminfo"),
        cgroup_root=str(tmp_path / "no-cgroup"),
        self_cgroup=str(tmp_path / "no-self-cgroup"),
        dev_dir=str(dev),
        nvidia_proc=str(tmp_path / "no-proc-driver"),
        search_path=str(bin_dir),
        visible_devices=visible,
    )


@pytest.mark.parametrize(
    "evidence,expect",
    [({"dev_nodes": ("nvidia0", "nvidiactl")}, "nvidia0"), ({"smi": True}, "nvidia-smi on PATH")],
)
def test_gpu_shown_but_torch_cannot_use_it_raises_naming_cause_and_fix(tmp_path, monkeypatch, evidence, expect):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    paths = _paths(tmp_path, **evidence)
    with pytest.raises(PlanError) as e:
        build_hardware(host_paths=paths)
    msg = str(e.value)
    assert expect in msg
    assert "CPU-only build" in msg and torch.__version__ in msg  # the real cause from the real torch
    assert "--gpus" in msg and "max_memory" in msg and "torch wheel" in msg


def test_declared_hardware_never_asks_the_driver(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    paths = _paths(tmp_path, dev_nodes=("nvidia0",))
    hw = build_hardware(gpus="1x24GiB", host_paths=paths)
    assert [d.id for d in hw.devices] == [0, "cpu"]
    assert build_hardware({"cpu": "1GiB"}, host_paths=paths).get("cpu").capacity == 2**30


def test_gpus_hidden_on_purpose_plan_cpu(tmp_path):
    paths = _paths(tmp_path, dev_nodes=("nvidia0",), visible="")
    hw = build_hardware(host_paths=paths)
    assert [d.id for d in hw.devices] == ["cpu"]


def test_no_gpu_driver_plans_cpu_for_real(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    paths = _paths(tmp_path)
    assert detect_gpus(paths).capacities == {}
    hw = build_hardware(host_paths=paths)
    assert [d.id for d in hw.devices] == ["cpu"] and hw.get("cpu").capacity == 16 * 2**30
    p = plan(llama_like(layers=4, hidden=128, intermediate=344, vocab=512), hardware=hw)
    assert set(p.device_map.values()) == {"cpu"}
