"""Every way plan() can be handed bad input answers with a PlanError that says what to do."""

from __future__ import annotations

import json

import pytest

from planner.api import plan
from planner.errors import HardwareSpecError, ModelSourceError, PlanError
from tests.planner.synthetic import llama_like

SKEL = llama_like(layers=4, hidden=64, intermediate=128, vocab=100)
TIED = llama_like(layers=4, hidden=64, intermediate=128, vocab=100, tied=True)
CPU = {"cpu": "1GiB"}


def test_unknown_strategy_suggests_the_nearest():
    with pytest.raises(PlanError, match="did you mean 'balanced'"):
        plan(SKEL, max_memory=CPU, strategy="balance")


@pytest.mark.parametrize(
    "mm,match",
    [
        ({"cpu": "12 parsecs"}, "unknown unit"),
        ({"cpu": "-1GiB"}, "negative"),
        ({"gpu7x": "1GiB"}, "unknown device"),
        ({"cpu": -10}, "negative"),
    ],
)
def test_bad_max_memory(mm, match):
    with pytest.raises(HardwareSpecError, match=match):
        plan(SKEL, max_memory=mm)


def test_custom_map_with_unknown_module_suggests_real_names():
    with pytest.raises(PlanError) as e:
        plan(SKEL, max_memory={0: "1GiB", "cpu": "1GiB"}, strategy={"model.layer.1": 0, "": "cpu"})
    assert "model.layers.1" in str(e.value) and "not a module" in str(e.value)


def test_custom_map_leaving_tensors_uncovered_is_an_error_unless_completed():
    mm = {0: "1GiB", "cpu": "1GiB"}
    with pytest.raises(PlanError, match="without a device"):
        plan(SKEL, max_memory=mm, strategy={"model.layers": 0})
    p = plan(SKEL, max_memory=mm, strategy={"model.layers": "cpu"}, complete=True, gpu_reserve=0)
    assert all(p.placement[f"model.layers.{i}"] == "cpu" for i in range(4))
    assert p.placement["model.embed_tokens"] == 0 and p.strategy == "custom"


def test_custom_map_accepts_root_prefixes_single_params_and_device_spellings():
    mm = {0: "1GiB", 1: "1GiB", "cpu": "1GiB"}
    p = plan(
        SKEL,
        max_memory=mm,
        gpu_reserve=0,
        strategy={"": "cpu", "model.layers.1": "cuda:1", "model.layers.2": "0", "lm_head.weight": 1},
    )
    assert p.placement["model.layers.1"] == 1 and p.placement["model.layers.2"] == 0
    assert p.placement["lm_head"] == 1 and p.placement["model.norm"] == "cpu"
    assert json.loads(p.to_json())["device_map"]["model.layers.1"] == 1


def test_custom_map_cannot_split_a_no_split_block_or_a_tied_group():
    mm = {0: "1GiB", "cpu": "1GiB"}
    with pytest.raises(PlanError, match="splits a no-split module 'model.layers.0'"):
        plan(SKEL, max_memory=mm, strategy={"": "cpu", "model.layers.0.mlp.up_proj.weight": 0})
    with pytest.raises(PlanError, match="tied weights"):
        plan(TIED, max_memory=mm, strategy={"": "cpu", "lm_head": 0})


def test_custom_map_naming_an_absent_device():
    with pytest.raises(PlanError, match="not among the planned devices"):
        plan(SKEL, max_memory=CPU, strategy={"": 3})


def test_custom_map_over_capacity_names_the_shortfall():
    with pytest.raises(PlanError) as e:
        plan(SKEL, max_memory={0: "1MiB", "cpu": "1GiB"}, strategy={"": 0}, gpu_reserve=0)
    assert "GPU 0 needs" in str(e.value) and "short by" in str(e.value)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(batch_size=0), "batch_size must be at least 1"),
        (dict(context=-5), "context must be at least 1"),
        (dict(batch_size=1.5), "whole number"),
        (dict(dtype="fp8"), "unknown dtype"),
        (dict(quantization="int3"), "unknown quantization"),
    ],
)
def test_bad_workload(kw, match):
    with pytest.raises(PlanError, match=match):
        plan(SKEL, max_memory=CPU, **kw)


def test_nothing_fits_names_the_shortfall_and_the_changes_that_would_fit():
    big = llama_like(layers=8, hidden=512, intermediate=1376, vocab=4096)
    mm = {0: "48MiB", "cpu": "48MiB"}
    with pytest.raises(PlanError) as e:
        plan(big, max_memory=mm, dtype="fp32", batch_size=4, context=256, gpu_reserve=0)
    msg = str(e.value)
    assert "does not fit" in msg and "short by" in msg
    assert "bf16" in msg and "--quantization" in msg
    # every suggestion is real: the suggested change does fit
    plan(big, max_memory=mm, dtype="bf16", batch_size=4, context=256, gpu_reserve=0)


def test_nothing_fits_on_a_cpu_only_machine_advises_the_native_cpu_quantization():
    """Without a GPU every layer computes on the CPU, where bitsandbytes is the slow path: the advice names
    --cpu-quantization, and the int8 it names does fit (planned with the native int8 format's byte counts)."""
    big = llama_like(layers=8, hidden=512, intermediate=1376, vocab=4096)
    mm = {"cpu": "40MiB"}
    with pytest.raises(PlanError) as e:
        plan(big, max_memory=mm, dtype="bf16", context=256)
    msg = str(e.value)
    assert "--cpu-quantization int8" in msg and "--quantization" not in msg.replace("--cpu-quantization", "")
    plan(big, max_memory=mm, dtype="bf16", context=256, cpu_quantization="int8")
    # with a GPU in the map, bitsandbytes stays the advice
    with pytest.raises(PlanError) as e:
        plan(big, max_memory={0: "20MiB", "cpu": "20MiB"}, dtype="bf16", context=256, gpu_reserve=0)
    assert "(--quantization " in str(e.value) and "--cpu-quantization" not in str(e.value)


def test_shorter_context_and_smaller_batch_are_suggested_with_exact_limits():
    mm = {0: "24MiB"}
    with pytest.raises(PlanError) as e:
        plan(SKEL, max_memory=mm, dtype="fp32", batch_size=8, context=8192, gpu_reserve=0)
    msg = str(e.value)
    assert "--context" in msg and "--batch-size" in msg
    ctx = int(msg.split("--context ")[1].split(")")[0])
    plan(SKEL, max_memory=mm, dtype="fp32", batch_size=8, context=ctx, gpu_reserve=0)
    with pytest.raises(PlanError):
        plan(SKEL, max_memory=mm, dtype="fp32", batch_size=8, context=ctx + 1, gpu_reserve=0, advise=False)


def test_model_sources(tmp_path, tiny_llama):
    with pytest.raises(ModelSourceError):
        plan(tmp_path / "missing", max_memory=CPU)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError):
        plan(empty, max_memory=CPU)
    cfg = json.loads((tiny_llama / "config.json").read_text())
    from_dir = plan(tiny_llama, max_memory=CPU)
    from_json = plan(tiny_llama / "config.json", max_memory=CPU)
    from_dict = plan(cfg, max_memory=CPU)
    assert from_dir.device_map == from_json.device_map == from_dict.device_map == {"": "cpu"}
    assert from_dir.budgets[0].weights == from_dict.budgets[0].weights
