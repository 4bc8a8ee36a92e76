"""KV-cache sizing of attention variants against the cache transformers really fills (issue 15): DeepSeek's
multi-head latent attention caches the compressed latent; sliding-window layers keep at most their window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from planner.model.skeleton import config_from_dict, load_skeleton
from planner.placement.sizing import size_blocks
from planner.types import Workload

BATCH, CONTEXT, WINDOW = 2, 12, 5

_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, vocab_size=128)

CONFIGS = {
    "deepseek_v3": dict(
        _SMALL,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "gemma2": dict(
        _SMALL, model_type="gemma2", num_key_value_heads=2, head_dim=16, sliding_window=WINDOW
    ),  # no layer_types: the family alternates
    "mistral": dict(_SMALL, model_type="mistral", num_key_value_heads=2, sliding_window=WINDOW),
    "gpt_oss": dict(
        _SMALL,
        model_type="gpt_oss",
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen2_no_sliding": dict(_SMALL, model_type="qwen2", num_key_value_heads=2, sliding_window=WINDOW),
}


def _real_cache_bytes(doc: dict) -> list[int]:
    """Bytes each layer's cache holds after a prefill of BATCH x CONTEXT tokens, in float32."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_from_dict(doc), dtype=torch.float32).eval()
    ids = torch.randint(0, doc["vocab_size"], (BATCH, CONTEXT))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [
        sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None) for layer in cache.layers
    ]


def _planned_cache_bytes(doc: dict) -> list[int]:
    skel = load_skeleton(dict(doc))
    items = size_blocks(skel, Workload(dtype="float32", batch_size=BATCH, context=CONTEXT))
    return [it.kv for it in items if it.is_layer]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_kv_cache_sized_as_transformers_fills_it(family):
    doc = CONFIGS[family]
    real, planned = _real_cache_bytes(doc), _planned_cache_bytes(doc)
    assert len(real) == len(planned)
    skel = load_skeleton(dict(doc))
    sliding = set(skel.kv.sliding_layers)
    per_token = skel.kv.per_token * 4 * BATCH
    for i, (r, p) in enumerate(zip(real, planned)):
        if i in sliding:
            # transformers keeps window - 1 tokens after an update (the window while it attends): the plan budgets
            # the window, at most one token more than what stays cached
            assert r < p <= r + per_token, (family, i, r, p)
        else:
            assert p == r, (family, i, r, p)
    if family == "deepseek_v3":
        assert skel.kv.per_token == 16 + 8 and "latent" in skel.kv.layout
    if family == "gemma2":
        assert sorted(sliding) == [0, 2]
    if family == "mistral":
        assert sorted(sliding) == [0, 1, 2, 3]
    if family == "qwen2_no_sliding":
        assert not sliding


def test_mla_kv_is_explained_in_the_plan():
    from planner.api import plan
    from tests.planner.model.test_moe import CONFIGS as EXAMPLES

    p = plan(str(EXAMPLES / "deepseek-v3.json"), gpus="8x80GB", max_memory={"cpu": "2TiB"}, batch_size=4, context=8192)
    why = " ".join(p.reasons)
    assert "multi-head latent attention" in why and "576 values per token" in why
    assert sum(b.kv_cache for b in p.budgets) == 61 * 576 * 2 * 4 * 8192  # bf16
