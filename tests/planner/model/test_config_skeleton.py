"""The config-only Skeleton equals the meta-model walk, family by family, so the two cannot drift.

Each family is checked on several configs (tied and untied heads, GQA and MHA, each dtype, explicit head dims,
biases, RoPE scaling, MoE sizes and layer patterns). A failure names the first block that differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.model.config_skeleton import FAMILIES, config_skeleton
from planner.model.skeleton import load_skeleton, skeleton_from_config, skeleton_from_dir
from tests.models import tiny_gpt2_dir, tiny_llama_dir, tiny_moe_dir

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "configs"

_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=128)

CASES: dict[str, list[dict]] = {
    "llama": [
        dict(_SMALL, num_key_value_heads=2),
        dict(_SMALL, tie_word_embeddings=True, dtype="bfloat16"),
        dict(_SMALL, num_key_value_heads=1, head_dim=32, attention_bias=True, mlp_bias=True, torch_dtype="float16"),
        dict(
            _SMALL,
            num_key_value_heads=2,
            dtype="bfloat16",
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ],
    "mistral": [
        dict(_SMALL, num_key_value_heads=2, sliding_window=16, head_dim=None),  # null, as saved configs write it
        dict(_SMALL, num_key_value_heads=4, head_dim=24, dtype="bfloat16", tie_word_embeddings=True),
        dict(_SMALL, num_attention_heads=8),  # the default 8 KV heads
    ],
    "mixtral": [
        dict(_SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, dtype="bfloat16"),
        dict(_SMALL, num_attention_heads=8, num_local_experts=3, num_experts_per_tok=1, tie_word_embeddings=True),
        dict(_SMALL, num_key_value_heads=4, num_experts=5, num_experts_per_tok=2),
    ],
    "qwen2": [
        dict(_SMALL, num_key_value_heads=2, dtype="bfloat16"),
        dict(_SMALL, num_key_value_heads=4, tie_word_embeddings=True, use_sliding_window=True, max_window_layers=1),
        dict(_SMALL, num_key_value_heads=1, head_dim=8, dtype="float16"),
    ],
    "qwen3": [
        dict(_SMALL, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, dtype="bfloat16"),
        dict(_SMALL, num_key_value_heads=2),  # head_dim defaults to 128 whatever the hidden size
        dict(_SMALL, num_key_value_heads=4, head_dim=32, attention_bias=True),
    ],
    "qwen2_moe": [
        dict(
            _SMALL,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            dtype="bfloat16",
        ),
        dict(
            _SMALL,
            num_key_value_heads=4,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=40,
            decoder_sparse_step=2,
            mlp_only_layers=[0],
            qkv_bias=False,
        ),
        dict(
            _SMALL,
            num_key_value_heads=2,
            num_experts=3,
            num_experts_per_tok=1,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            tie_word_embeddings=True,
        ),
    ],
    "qwen3_moe": [
        dict(
            _SMALL,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            dtype="bfloat16",
        ),
        dict(
            _SMALL,
            num_key_value_heads=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            mlp_only_layers=[2],
            head_dim=32,
            attention_bias=True,
        ),
    ],
    "gemma": [
        dict(_SMALL, num_key_value_heads=1, head_dim=16, dtype="bfloat16"),
        dict(_SMALL, num_key_value_heads=4, tie_word_embeddings=False),  # head_dim defaults to 256
    ],
    "gemma2": [
        dict(_SMALL, num_key_value_heads=2, head_dim=16, dtype="bfloat16", query_pre_attn_scalar=16, sliding_window=8),
        dict(_SMALL, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False, num_hidden_layers=4),
    ],
    "gemma3_text": [
        dict(_SMALL, num_key_value_heads=2, head_dim=16, dtype="bfloat16"),  # 3 layers: sliding only
        dict(_SMALL, num_key_value_heads=2, head_dim=16, num_hidden_layers=7, rope_local_base_freq=10000.0),
        dict(
            _SMALL,
            num_key_value_heads=1,
            head_dim=16,
            num_hidden_layers=4,
            sliding_window_pattern=2,
            tie_word_embeddings=False,
        ),
        dict(_SMALL, head_dim=16, layer_types=["full_attention", "sliding_attention", "full_attention"]),
    ],
    "phi3": [
        dict(_SMALL, vocab_size=32064, num_key_value_heads=2, dtype="bfloat16"),
        dict(
            _SMALL,
            vocab_size=32064,
            tie_word_embeddings=True,
            pad_token_id=0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            original_max_position_embeddings=4096,
            auto_map={"AutoConfig": "configuration_phi3.Phi3Config"},
            rope_scaling=None,
        ),
    ],
    "gpt2": [
        dict(n_embd=64, n_layer=3, n_head=4, vocab_size=128, n_positions=32),
        dict(
            n_embd=64,
            n_layer=2,
            n_head=8,
            vocab_size=100,
            n_positions=16,
            n_inner=80,
            dtype="float16",
            tie_word_embeddings=False,
        ),
        dict(
            n_embd=48,
            n_layer=2,
            n_head=3,
            vocab_size=90,
            n_positions=20,
            dtype="bfloat16",
            n_ctx=20,
            activation_function="gelu",
        ),
    ],
}


def _cases() -> list:
    return [pytest.param(mt, cfg, id=f"{mt}-{i}") for mt, cfgs in CASES.items() for i, cfg in enumerate(cfgs)]


def test_every_family_is_checked() -> None:
    assert set(CASES) == set(FAMILIES)


def _assert_equal(fast, walked) -> None:
    assert fast is not None, "the config-only builder declined a config of a family it models"
    assert [b.name for b in fast.blocks] == [b.name for b in walked.blocks]
    for a, b in zip(fast.blocks, walked.blocks):
        assert a == b, f"block {a.name} differs:\n  config: {a}\n  walk:   {b}"
    assert fast == walked


@pytest.mark.parametrize("model_type,cfg", _cases())
def test_config_skeleton_equals_meta_walk(model_type: str, cfg: dict) -> None:
    config = dict(cfg, model_type=model_type)
    _assert_equal(config_skeleton(config), skeleton_from_config(config, meta_walk=True))


@pytest.mark.parametrize(
    "path",
    sorted(p for p in EXAMPLES.glob("*.json") if json.loads(p.read_text())["model_type"] in FAMILIES),
    ids=lambda p: p.stem,
)
def test_example_configs_take_the_fast_path_and_equal_the_walk(path: Path) -> None:
    fast = skeleton_from_config(path)
    assert fast == config_skeleton(json.loads(path.read_text()), name=path.stem)
    _assert_equal(fast, skeleton_from_config(path, meta_walk=True))


@pytest.mark.parametrize(
    "extra",
    [
        {"quantization_config": {"quant_method": "fp8"}},  # may change what the model holds: not modelled
        {"partial_rotary_factor": 0.5},
        {"rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 2, 4]}},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},  # transformers' rules for yarn are not copied here
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},  # transformers refuses it: keys missing
        {"dtype": "float64"},
        {"hidden_size": 66},  # not a multiple of the heads: transformers must be the one to say so
        {"model_type": None, "architectures": ["LlamaForCausalLM"]},  # which model_type is transformers' choice
    ],
)
def test_configs_it_does_not_model_fall_back_to_the_walk(extra: dict) -> None:
    config = {**CASES["llama"][0], "model_type": "llama", **extra}
    assert config_skeleton(config) is None


def test_unknown_family_falls_back_to_the_walk() -> None:
    config = json.loads((EXAMPLES / "falcon-7b.json").read_text())
    assert config_skeleton(config) is None
    assert load_skeleton(config).architecture == "FalconForCausalLM"


@pytest.mark.parametrize("make", [tiny_llama_dir, tiny_gpt2_dir, tiny_moe_dir], ids=["llama", "gpt2", "mixtral"])
def test_checkpoint_directories_equal_the_walk(make) -> None:
    """A model directory's skeleton (config + headers: stored dtypes, checkpoint keys of fused experts) is the same
    whichever builder laid out the config."""
    model_dir = make()
    assert config_skeleton(json.loads((model_dir / "config.json").read_text())) is not None
    _assert_equal(skeleton_from_dir(model_dir), skeleton_from_dir(model_dir, meta_walk=True))
