"""``--speculate int4|int8``'s copy: refused beside a plan that uses a GPU, with what to do instead; loaded through the
``--cpu-quantization`` load with every linear layer below the head in the asked scheme."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.model.background_load import refuse_draft_beside_gpus
from service.model.draft_copy import load_draft_copy


def test_a_plan_with_gpu_layers_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"--speculate int4 .* GPU 0, 1, .*--speculate ngram"):
        refuse_draft_beside_gpus("int4", {"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": "cpu"})
    refuse_draft_beside_gpus("int8", {"": "cpu", "model.layers.3": "disk"})  # CPU and disk: drafts


def test_the_copy_is_quantized_in_the_asked_scheme_on_the_cpu(tiny_llama: Path) -> None:
    copy = load_draft_copy(tiny_llama, "int4", "bfloat16")
    stats = copy.model.load_stats.cpu_quantization
    assert stats.scheme == "int4" and stats.layers > 0 and stats.schemes.get("int4", 0) > 0
    assert copy.dtype == "bfloat16" and set(copy.model.hf_device_map.values()) == {"cpu"}
    assert stats.bytes_after < stats.bytes_before / 2  # 4-bit weights with their scales, against bf16


def test_the_plan_reserves_what_the_copy_holds(tiny_llama: Path) -> None:
    """The target's plan reserves the copy from the target's Skeleton (:func:`copy_budget`) before it is loaded: its
    quantized weights are what the load then holds, and its KV is the target's geometry in the copy's dtype."""
    from planner.placement.inputs import PlanInputs
    from service.model.draft_copy import copy_budget

    for scheme in ("int4", "int8"):
        budget = copy_budget(tiny_llama, scheme, PlanInputs(dtype="float32"))
        copy = load_draft_copy(tiny_llama, scheme, "float32")
        assert budget.label == f"{scheme} copy" and budget.device == "cpu" and budget.working > 0
        assert abs(budget.weights - copy.nbytes) <= 0.02 * copy.nbytes, (scheme, budget.weights, copy.nbytes)
    # 4 layers x K and V x 2 KV heads x 16 values, 4 bytes each (fp32), per token; bf16 (a bf16/fp16 target) halves it
    assert budget.kv_per_token == 4 * 2 * 2 * 16 * 4
    assert copy_budget(tiny_llama, "int4", PlanInputs(dtype="float16")).kv_per_token == 4 * 2 * 2 * 16 * 2
