"""Models off the native decode step (mixtures of experts, GPT-2, sliding windows) run transformers' forward at every
CPU decode step, which costs more per layer than its reads (cost_model.MODULE_LAYER_SECONDS, ROUTED_LAYER_SECONDS);
and a cold disk's hit experts are read in the step's own time, at a share of the streamed rate, not overlapped."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.api import plan
from planner.model.decode_path import NATIVE_DECODE_LAYERS, runs_module_forward
from planner.model.skeleton import load_skeleton
from planner.placement.cost_model import HIT_EXPERT_READS, MODULE_LAYER_SECONDS, ROUTED_LAYER_SECONDS

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
ROOMY = {"cpu": "2TiB"}


@pytest.mark.parametrize(
    ("name", "module_forward"),
    [("llama-3-8b", False), ("qwen2-72b", False), ("mixtral-8x7b", True), ("gpt-oss-20b", True), ("gpt2-xl", True)],
)
def test_which_models_decode_on_the_native_step(name: str, module_forward: bool) -> None:
    skel = load_skeleton(str(CONFIGS / f"{name}.json"))
    assert runs_module_forward(skel) is module_forward
    assert (skel.model_type in NATIVE_DECODE_LAYERS) is (name in ("llama-3-8b", "qwen2-72b"))


def test_the_forward_costs_each_layer_and_more_each_moe_layer() -> None:
    llama = plan(str(CONFIGS / "llama-3-8b.json"), max_memory=ROOMY, dtype="bfloat16")
    assert "forward" not in llama.prediction.seconds_per_token_by_device
    for name, layers in (("mixtral-8x7b", 32), ("gpt2-xl", 48)):
        p = plan(str(CONFIGS / f"{name}.json"), max_memory=ROOMY, dtype="bfloat16")
        routed = ROUTED_LAYER_SECONDS if name.startswith("mixtral") else 0.0
        seconds = p.prediction.seconds_per_token_by_device
        assert seconds["forward"] == pytest.approx(layers * (MODULE_LAYER_SECONDS + routed), rel=1e-4)
        assert p.prediction.decode_tokens_per_s == pytest.approx(p.workload.batch_size / sum(seconds.values()), 1e-3)
        assert "off the native decode step" in p.prediction.cost_model


def test_a_cold_disks_hit_experts_hold_up_the_step() -> None:
    """gpt-oss-20b in bf16 in 8 GiB: most MoE layers on a cold disk. The readahead thread streams their dense parts
    while the CPU computes; the hit experts are read once the router has chosen, so the step is their reads plus the
    larger of the streamed reads and the rest."""
    p = plan(str(CONFIGS / "gpt-oss-20b.json"), max_memory={"cpu": "8GiB", "disk": "64GiB"}, dtype="bfloat16")
    seconds = p.prediction.seconds_per_token_by_device
    hit, disk = seconds[HIT_EXPERT_READS], seconds["disk"]
    assert hit > 0 and disk > 0 and p.prediction.disk_cached is False
    rest = sum(seconds.values()) - hit - disk
    assert p.prediction.decode_tokens_per_s == pytest.approx(p.workload.batch_size / (hit + max(disk, rest)), 1e-3)


def test_a_plan_without_a_disk_share_says_nothing_of_the_page_cache() -> None:
    assert plan(str(CONFIGS / "llama-3-8b.json"), max_memory=ROOMY).prediction.disk_cached is None
