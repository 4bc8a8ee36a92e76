"""Skeletons built from plain numbers, without torch: what the planner's pure tests and property tests use."""

from __future__ import annotations

from planner.types import Block, KVGeometry, Skeleton, TensorSpec


def llama_like(
    layers: int = 8,
    hidden: int = 256,
    intermediate: int = 688,
    vocab: int = 1000,
    heads: int = 8,
    kv_heads: int = 2,
    tied: bool = False,
    dtype: str = "float32",
    name: str = "synthetic-llama",
) -> Skeleton:
    head_dim = hidden // heads

    def linear(n: str, out_f: int, in_f: int) -> TensorSpec:
        return TensorSpec(f"{n}.weight", (out_f, in_f), dtype, "parameter", True, True)

    blocks = [
        Block(
            "model.embed_tokens", (TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype),), is_embedding=True
        )
    ]
    for i in range(layers):
        p = f"model.layers.{i}"
        ts = (
            linear(f"{p}.self_attn.q_proj", hidden, hidden),
            linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden),
            linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden),
            linear(f"{p}.self_attn.o_proj", hidden, hidden),
            linear(f"{p}.mlp.gate_proj", intermediate, hidden),
            linear(f"{p}.mlp.up_proj", intermediate, hidden),
            linear(f"{p}.mlp.down_proj", hidden, intermediate),
            TensorSpec(f"{p}.input_layernorm.weight", (hidden,), dtype),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), dtype),
        )
        blocks.append(Block(p, ts, no_split=True, layer_index=i))
    blocks.append(Block("model.norm", (TensorSpec("model.norm.weight", (hidden,), dtype),)))
    blocks.append(
        Block(
            "model.rotary_emb",
            (TensorSpec("model.rotary_emb.inv_freq", (head_dim // 2,), "float32", "buffer_nonpersistent"),),
        )
    )
    tied_groups: tuple[tuple[str, ...], ...] = ()
    if tied:
        blocks.append(Block("lm_head", (), is_head=True))
        tied_groups = (("model.embed_tokens.weight", "lm_head.weight"),)
    else:
        blocks.append(Block("lm_head", (TensorSpec("lm_head.weight", (vocab, hidden), dtype),), is_head=True))
    return Skeleton(
        name=name,
        architecture="LlamaForCausalLM",
        model_type="llama",
        blocks=tuple(blocks),
        tied_groups=tied_groups,
        no_split_classes=("LlamaDecoderLayer",),
        kv=KVGeometry(layers, kv_heads, head_dim),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        default_dtype=dtype,
    )
