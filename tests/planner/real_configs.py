"""Configs of real, public models at their real sizes, written from their published config.json values.

Only the fields that shape the weights and the KV cache are given; everything else takes transformers' defaults.
``PUBLIC`` holds, per model, the published parameter count and the KV-cache geometry the published config implies,
so tests can check the skeleton against facts that do not come from our own code.

:func:`checkpoint_tensors` lists the tensors a checkpoint of the model stores, under the names and in the layout
of the published checkpoints (per-expert keys for Mixtral); with
:func:`tests.sparse_checkpoint.write_sparse_checkpoint` it makes a real, full-size, sparse checkpoint on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.types import Skeleton
from tests.sparse_checkpoint import write_sparse_checkpoint


@dataclass(frozen=True)
class PublicFacts:
    params: float  # published parameter count
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tied: bool


REAL_CONFIGS: dict[str, dict] = {
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    # meta-llama/Meta-Llama-3-70B
    "llama-3-70b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    # Qwen/Qwen2-72B
    "qwen2-72b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
        max_position_embeddings=131072,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    # openai-community/gpt2-xl (lm_head tied to transformer.wte)
    "gpt2-xl": dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        n_embd=1600,
        n_layer=48,
        n_head=25,
        n_positions=1024,
        vocab_size=50257,
        dtype="float32",
    ),
    # google/gemma-2-27b (embeddings tied)
    "gemma-2-27b": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_size=4608,
        intermediate_size=36864,
        num_hidden_layers=46,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        vocab_size=256000,
        max_position_embeddings=8192,
        query_pre_attn_scalar=144,
        sliding_window=4096,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
    # tiiuae/falcon-7b (multi-query attention, parallel attention/MLP, tied head)
    "falcon-7b": dict(
        architectures=["FalconForCausalLM"],
        model_type="falcon",
        hidden_size=4544,
        num_hidden_layers=32,
        num_attention_heads=71,
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        bias=False,
        alibi=False,
        vocab_size=65024,
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
    # microsoft/Phi-3-mini-4k-instruct
    "phi-3-mini": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
}

PUBLIC: dict[str, PublicFacts] = {
    "llama-3-8b": PublicFacts(8.03e9, 32, 8, 128, False),
    "llama-3-70b": PublicFacts(70.6e9, 80, 8, 128, False),
    "mixtral-8x7b": PublicFacts(46.7e9, 32, 8, 128, False),
    "qwen2-72b": PublicFacts(72.71e9, 80, 8, 128, False),
    "gpt2-xl": PublicFacts(1.558e9, 48, 25, 64, True),  # released as "1558M"
    "gemma-2-27b": PublicFacts(27.2e9, 46, 16, 128, True),
    "falcon-7b": PublicFacts(6.92e9, 32, 1, 64, True),
    "phi-3-mini": PublicFacts(3.82e9, 32, 32, 96, False),
}


def checkpoint_tensors(name: str, skel: Skeleton) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensors a published checkpoint of ``name`` stores: name -> (dtype, shape), in the published layout.

    Persistent parameters only (tied aliases stored once). For Mixtral, the fused expert tensors of the module
    tree (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) are written as the
    published per-expert ``block_sparse_moe.experts.E.w1/w2/w3.weight`` keys, and ``mlp.gate`` as
    ``block_sparse_moe.gate``.
    """
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for t in skel.tensors():
        if t.kind == "buffer_nonpersistent":
            continue
        if REAL_CONFIGS[name]["model_type"] == "mixtral" and ".mlp." in t.name:
            layer, _, rest = t.name.partition(".mlp.")
            moe = f"{layer}.block_sparse_moe"
            if rest == "experts.gate_up_proj":
                n_exp, two_i, hidden = t.shape
                for e in range(n_exp):
                    out[f"{moe}.experts.{e}.w1.weight"] = (t.dtype, (two_i // 2, hidden))
                    out[f"{moe}.experts.{e}.w3.weight"] = (t.dtype, (two_i // 2, hidden))
                continue
            if rest == "experts.down_proj":
                n_exp, hidden, inter = t.shape
                for e in range(n_exp):
                    out[f"{moe}.experts.{e}.w2.weight"] = (t.dtype, (hidden, inter))
                continue
            out[f"{moe}.{rest}"] = (t.dtype, t.shape)
            continue
        out[t.name] = (t.dtype, t.shape)
    return out


def write_real_checkpoint(name: str, skel: Skeleton, directory: str | Path, shards: int) -> list[Path]:
    """A full-size sparse checkpoint of ``name`` (headers real, data a hole) plus its config.json."""
    import json

    directory = Path(directory)
    paths = write_sparse_checkpoint(directory, checkpoint_tensors(name, skel), shards=shards)
    (directory / "config.json").write_text(json.dumps(REAL_CONFIGS[name]), encoding="utf-8")
    return paths
