"""The GGUF writer's pure parts (the llama.cpp peer itself runs outside CI): the rotary row order and the names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from bench.peers.gguf_export import LlamaShape, gguf_name, interleave_rotary_rows


def _adjacent_pair_rope(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as llama.cpp applies it to a Llama: elements 2i and 2i+1 of a head rotate together."""
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * theta.cos() - b * theta.sin()
    out[..., 1::2] = a * theta.sin() + b * theta.cos()
    return out


def test_reordered_rows_make_llama_cpp_rotary_equal_transformers() -> None:
    heads, head_dim, hidden, pos = 3, 8, 10, 5
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(heads * head_dim, hidden, generator=g)
    x = torch.randn(hidden, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = pos * inv_freq  # one angle per rotating pair

    # transformers: halves [0, d/2) and [d/2, d) of each head rotate together
    q = (weight @ x).view(1, heads, 1, head_dim)
    cos = torch.cat([angles, angles]).cos().view(1, 1, head_dim)
    sin = torch.cat([angles, angles]).sin().view(1, 1, head_dim)
    hf, _ = apply_rotary_pos_emb(q, q, cos, sin)

    reordered = torch.from_numpy(interleave_rotary_rows(weight.numpy(), heads))
    ours = _adjacent_pair_rope((reordered @ x).view(heads, head_dim), angles)
    # the same values, each head's halves interleaved
    want = hf.view(heads, 2, head_dim // 2).transpose(1, 2).reshape(heads, head_dim)
    torch.testing.assert_close(ours, want)
    # and without the reordering they differ: the test can fail
    assert not torch.allclose(_adjacent_pair_rope((weight @ x).view(heads, head_dim), angles), hf.view(heads, -1))


def test_rows_that_do_not_split_into_even_heads_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split"):
        interleave_rotary_rows(np.zeros((9, 4), dtype=np.float32), 3)


def test_names_follow_llama_cpp() -> None:
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("model.layers.12.self_attn.k_proj.weight") == "blk.12.attn_k.weight"
    assert gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_name("model.layers.3.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(ValueError, match="no llama.cpp name"):
        gguf_name("model.layers.0.self_attn.q_norm.weight")


def test_only_plain_llama_configs_are_exported() -> None:
    base = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    shape = LlamaShape.from_config(base)
    assert (shape.head_dim, shape.kv_heads, shape.rope_theta) == (16, 2, 10000.0)
    with pytest.raises(ValueError, match="only Llama"):
        LlamaShape.from_config({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="rope scaling"):
        LlamaShape.from_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
