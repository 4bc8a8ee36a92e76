"""bench/gpu_check's checks, run with the CPU standing in for GPU 0 (the only way they run without a GPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import loaders
from bench import gpu_check


def _cpu_argv(model_dir: Path, work_dir: Path, out: Path) -> list[str]:
    """gpu_check's arguments for a short run with the CPU standing in for the GPU."""
    return ["--cpu", "--model-dir", str(model_dir), "--new-tokens", "8", "--work-dir", str(work_dir), "--out", str(out)]


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", "bench/gpu_check.sh"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_the_cpu_run_passes_on_a_correct_loader(tiny_llama, tmp_path):
    out = tmp_path / "checks.json"
    argv = _cpu_argv(tiny_llama, tmp_path, out)
    assert gpu_check.main(argv) == 0
    checks = json.loads(out.read_text())["checks"]
    names = [c["name"] for c in checks]
    assert [c["ok"] for c in checks if "greedy" in c["name"]] == [True, True, True], names
    assert any("byte-exact" in n for n in names) and checks[-1]["ok"] is None


@pytest.mark.slow
def test_a_wrong_weight_fails_the_check(tiny_llama, tmp_path, monkeypatch):
    """The exit status fails on a mismatch: one weight off by 1e-2 shows in the logits and in the byte comparison."""
    load = loaders.load_model

    def off_by_a_little(*args, **kwargs):
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.add_(1e-2)
        return model

    monkeypatch.setattr(loaders, "load_model", off_by_a_little)
    out = tmp_path / "checks.json"
    argv = _cpu_argv(tiny_llama, tmp_path, out)
    assert gpu_check.main(argv) == 1
    checks = json.loads(out.read_text())["checks"]
    assert [c["ok"] for c in checks if "byte-exact" in c["name"]] == [False]


@pytest.mark.slow
def test_the_serving_comparison_runs_both_servers(tiny_llama, tmp_path):
    """``--serve`` on the CPU: loadmaster serve and transformers serve --continuous-batching, 4 clients each."""
    checks = gpu_check.check_serving(tiny_llama, "cpu", tmp_path, clients=4, max_tokens=8)
    by_name = {c.name: c for c in checks}
    assert by_name["serve (loadmaster): 4 concurrent clients"].ok, by_name
    assert by_name["serve (transformers): 4 concurrent clients"].ok, by_name
    assert "x tokens/s" in checks[-1].detail
