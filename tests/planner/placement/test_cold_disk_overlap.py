"""Without GPUs, a cold disk tier of two or more blocks is read by a thread while the CPU computes
(:mod:`loaders.run.readahead`): the cost model predicts a step as the larger of the disk's reads and the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.api import plan

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "configs" / "llama-3-8b.json"


def test_a_cold_disk_tier_overlaps_the_cpu_work() -> None:
    p = plan(str(CONFIG), max_memory={"cpu": "6GiB", "disk": "100GiB"}, dtype="bfloat16", context=2048)
    seconds = p.prediction.seconds_per_token_by_device
    disk_layers = [k for k, d in p.device_map.items() if d == "disk" and ".layers." in k]
    assert len(disk_layers) >= 2 and seconds["disk"] > 0 and seconds["cpu"] > 0, (disk_layers, seconds)
    rest = sum(v for k, v in seconds.items() if k != "disk")
    step = max(seconds["disk"], rest)
    assert p.prediction.decode_tokens_per_s == pytest.approx(p.workload.batch_size / step, rel=1e-3)
    assert p.prediction.decode_tokens_per_s > p.workload.batch_size / sum(seconds.values())
    assert "step = max(disk, rest)" in p.prediction.cost_model


def test_a_warm_disk_tier_is_summed() -> None:
    """Half the layers on disk, but the disk share fits the RAM left free: its pages stay cached after the first
    token, nothing is read while computing, and the step is the sum."""
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": "cpu" if i < 16 else "disk" for i in range(32)})
    p = plan(str(CONFIG), strategy=dm, max_memory={"cpu": "64GiB", "disk": "100GiB"}, dtype="bfloat16", context=2048)
    seconds = p.prediction.seconds_per_token_by_device
    assert seconds["disk"] > 0, seconds
    assert p.prediction.decode_tokens_per_s == pytest.approx(p.workload.batch_size / sum(seconds.values()), rel=1e-3)
