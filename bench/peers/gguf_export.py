"""Write a Llama safetensors checkpoint as a GGUF file, so llama.cpp runs the very weights loadmaster serves.

llama.cpp's own converter (``convert_hf_to_gguf.py``) lives in its source tree, not on PyPI, and refuses the
benchmark models' tokenizer (it recognises pre-tokenizers by a hash of known public ones). The peers pass token ids,
never text, so the tokenizer only has to describe the vocabulary; this module writes the file with the ``gguf``
package from PyPI (llama.cpp's own writer library):

- architecture ``llama``: block count, context, embedding and feed-forward lengths, heads and KV heads, rotary
  dimension and base, RMS-norm epsilon, from ``config.json``;
- tokenizer ``gpt2`` (byte-level BPE: the benchmark tokenizer's kind) with its vocabulary, merges and special ids;
- tensors under llama.cpp's names. Query and key rows are reordered: transformers' Llama rotates the two halves of
  each head (``rotate_half``), llama.cpp's rotates adjacent pairs, so each head's rows ``[0..d/2) ∪ [d/2..d)`` are
  interleaved. Norm vectors stay float32, as llama.cpp expects; matrices are written as ``f32``, ``bf16`` or
  ``q8_0`` (blocks of 32 int8 values with one float16 scale, quantized by ``gguf.quants``).

    .venv/bin/python -m bench.peers.gguf_export MODEL_DIR OUT.gguf --type q8_0
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: The weight formats a GGUF file is written in here, as llama.cpp names them.
TYPES = ("f32", "bf16", "q8_0")

#: transformers' per-layer names (after ``model.layers.N.``) and llama.cpp's (after ``blk.N.``).
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass(frozen=True)
class LlamaShape:
    """What llama.cpp's ``llama`` architecture needs to know of a transformers Llama config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_theta: float
    rms_eps: float
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaShape:
        if config.get("model_type") != "llama":
            raise ValueError(f"only Llama checkpoints are exported (model_type {config.get('model_type')!r})")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise ValueError("only plain rotary embeddings are exported (no rope scaling)")
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            context=config.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
        )


def interleave_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder a query or key projection's rows from transformers' half-split rotary layout to llama.cpp's
    adjacent-pair layout: within each head, row ``i`` of the first half and row ``i`` of the second half become
    rows ``2i`` and ``2i + 1``."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of an even size")
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name for a transformers Llama tensor; None for what llama.cpp does not store (rotary tables)."""
    if hf_name in TOP_TENSORS:
        return TOP_TENSORS[hf_name]
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        suffix = ".".join(parts[3:])
        if suffix in LAYER_TENSORS:
            return f"blk.{int(parts[2])}.{LAYER_TENSORS[suffix]}"
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    raise ValueError(f"{hf_name}: no llama.cpp name for this tensor")


def _vocabulary(model_dir: Path, vocab: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """Tokens, their GGUF types, merges and special ids of the checkpoint's byte-level BPE ``tokenizer.json``,
    padded with unused tokens up to the embedding's row count."""
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers are exported (this one is {model.get('type')})")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
    by_id.update(added)
    tokens, types = [], []
    for i in range(vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    config = json.loads((model_dir / "config.json").read_text())
    special = {k: config[f"{k}_token_id"] for k in ("bos", "eos", "pad") if config.get(f"{k}_token_id") is not None}
    return tokens, [int(t) for t in types], merges, special


def _tensor(name: str, value: Any, shape: LlamaShape) -> np.ndarray:
    """The tensor as float32 numpy, with rotary rows reordered where llama.cpp needs it."""
    import torch

    array = value.to(torch.float32).numpy()
    if name.endswith("attn_q.weight"):
        array = interleave_rotary_rows(array, shape.heads)
    elif name.endswith("attn_k.weight"):
        array = interleave_rotary_rows(array, shape.kv_heads)
    return array


def export(model_dir: Path, out: Path, weight_type: str = "f32") -> Path:
    """Write ``model_dir`` (a Llama safetensors checkpoint with its tokenizer) to ``out`` as GGUF; returns ``out``.

    Written to a temporary name and renamed, so a file at ``out`` is always complete."""
    import gguf
    from safetensors import safe_open

    QTYPES = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}  # noqa: N806
    if weight_type not in TYPES:
        raise ValueError(f"weight type {weight_type!r}: use one of {', '.join(TYPES)}")
    shape = LlamaShape.from_config(json.loads((model_dir / "config.json").read_text()))
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(model_dir.name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}
    writer.add_file_type(file_type.get(weight_type, gguf.LlamaFileType.MOSTLY_Q8_0))
    tokens, types, merges, special = _vocabulary(model_dir, shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, token_id in special.items():
        getattr(writer, f"add_{key}_token_id")(token_id)

    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                name = gguf_name(hf_name)
                if name is None:
                    continue
                array = _tensor(name, f.get_tensor(hf_name), shape)
                if array.ndim == 1 or weight_type == "f32":
                    writer.add_tensor(name, array)
                else:  # the quantized bytes, whose row length the writer turns back into the tensor's shape
                    qtype = QTYPES[weight_type]
                    writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    tmp.replace(out)
    log.info("wrote %s (%s, %.1f MB)", out, weight_type, out.stat().st_size / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--type", default="f32", choices=TYPES)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    export(args.model, args.out, args.type)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
