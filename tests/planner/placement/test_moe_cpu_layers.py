"""MoE layers whose non-expert part does not fit the GPUs (issue 15): the ``cpu_layers`` candidate computes them on
the CPU where they live, against streaming their attention to the GPU every step. Pure planner: published configs
on declared hardware, no weights and no torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.api import plan
from planner.hardware.devices import is_gpu
from planner.placement.cost_model import compute_dtype, predict
from planner.placement.inputs import PlanInputs, resolve_inputs
from planner.placement.solve import make_problem
from planner.placement.strategies import compute_loads
from planner.placement.sub_layer import CANDIDATE, CPU_LAYERS_CANDIDATE, experts_on_cpu_candidates

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
DEEPSEEK = str(CONFIGS / "deepseek-v3.json")
#: DeepSeek-V3's 61 layers without their experts (~26 GiB in bf16) do not fit one 24 GiB GPU.
HARDWARE = dict(gpus="1x24GiB", max_memory={"cpu": "2TiB"}, dtype="bf16", context=4096)


def _candidates(link: float) -> dict[str, float]:
    """Predicted tokens/s of each sub-layer candidate, as ``auto`` scores them."""
    inputs = resolve_inputs(DEEPSEEK, PlanInputs(bandwidths={"link": link}, **HARDWARE))
    problem = make_problem(inputs.skeleton, inputs.hardware, inputs.workload)
    out = {}
    for name, p, fill in experts_on_cpu_candidates(inputs.skeleton, problem):
        assert fill.assignment is not None, name
        loads = compute_loads(p, fill.assignment)
        out[name] = predict(p, fill.assignment, loads, 1, compute_dtype(inputs.workload)).decode_tokens_per_s
    return out


def test_layers_that_do_not_fit_compute_on_the_cpu_behind_a_slow_host_link():
    """Behind a 4 GB/s host link, streaming 22 layers' attention every step is slower than computing them where they
    live (host RAM, 20 GB/s): ``auto`` picks the cpu_layers candidate, predicts more than the streaming one, and its
    reasons say which layers compute on the CPU and why."""
    scores = _candidates(4e9)
    assert set(scores) == {CANDIDATE, CPU_LAYERS_CANDIDATE}
    assert scores[CPU_LAYERS_CANDIDATE] > 1.5 * scores[CANDIDATE]
    p = plan(DEEPSEEK, bandwidths={"link": 4e9}, **HARDWARE)
    assert p.strategy == f"auto:{CPU_LAYERS_CANDIDATE}"
    assert p.prediction.decode_tokens_per_s == pytest.approx(scores[CPU_LAYERS_CANDIDATE], rel=1e-3)
    why = " ".join(p.reasons)
    assert f"auto chose {CPU_LAYERS_CANDIDATE}" in why and f"vs {CANDIDATE}:" in why
    assert "compute wholly on the CPU where they live" in why
    # the layers the GPU cannot hold are cpu keys the plan lists as computed there, after every GPU layer
    host_layers = [k for k in p.cpu_compute if k.startswith("model.layers.") and not k.endswith(".experts")]
    assert len(host_layers) >= 10
    first_host = min(int(k.split(".")[2]) for k in host_layers)
    for i in range(61):
        dev = p.placement[f"model.layers.{i}"]
        assert (dev == "cpu") == (i >= first_host), i
        assert (f"model.layers.{i}" in p.cpu_compute) == (i >= first_host)
    assert all(p.device_map[k] == "cpu" for k in p.cpu_compute)
    # nothing but the input embeddings crosses the link, and the CPU holds those layers' KV cache
    assert p.offloaded_bytes < 2 * 2**30
    cpu = p.budget("cpu")
    assert cpu is not None and cpu.kv_cache > 0
    assert all(b.total <= b.capacity for b in p.budgets)
    assert any(is_gpu(d) for d in p.placement.values())


def test_auto_takes_the_candidate_predicted_fastest_whatever_the_link():
    """The choice follows the prediction: at each link speed, ``auto``'s plan is within 1% of the best candidate's
    predicted tokens/s (the tie rule may then prefer the lower GPU use)."""
    for link in (4e9, 25e9):
        scores = _candidates(link)
        p = plan(DEEPSEEK, bandwidths={"link": link}, **HARDWARE)
        assert p.prediction.decode_tokens_per_s >= 0.99 * max(scores.values()), (link, scores, p.strategy)
        assert "experts_on_cpu" in p.strategy


def test_models_whose_layers_fit_get_no_cpu_layers_candidate():
    """Mixtral's attention fits one 24 GiB GPU: the all-split plan streams nothing, so no layer computes on the CPU
    and the plan lists only routed experts there."""
    p = plan(str(CONFIGS / "mixtral-8x7b.json"), gpus="1x24GiB", max_memory={"cpu": "256GiB"})
    assert "cpu_layers" not in p.strategy
    assert p.cpu_compute and all(k.endswith(".mlp.experts") for k in p.cpu_compute)
