"""The Skeleton of a common causal LM computed from its config alone: no torch, no transformers, no meta model.

Planning from a config used to cost seconds before the first byte was sized: importing torch and transformers and
instantiating the model on the meta device. For the families below the module tree is simple enough to write down,
so :func:`config_skeleton` lays out the same blocks, tensors (names, shapes, dtypes, kinds), tied groups and
geometry that :func:`planner.model.meta_skeleton.skeleton_from_model` reads off the meta model of the installed transformers.
``tests/planner/model/test_config_skeleton.py`` proves the two equal, family by family, so they cannot drift.

The fast path is taken only when it is sure. Any config key it does not know to be harmless (one that might add,
drop or reshape a tensor), any value transformers would reject, an unusual RoPE, or a family not listed here
returns ``None``, and the caller walks the meta model as before: slower, never wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.model.config_values import (
    CONFIG_NAME,
    SLIDING_DEFAULTS,
    default_dtype,
    dtype_name,
    kv_geometry,
    model_sizes,
)
from planner.types import Block, Skeleton, TensorSpec

log = logging.getLogger(__name__)

#: Config keys that shape no tensor in any family here (token ids, dropout, norms' epsilons, positional limits,
#: attention windows and soft-caps, routing losses, bookkeeping; ``auto_map`` names remote code, which the walk does
#: not run either). A key outside this set and outside the family's own ``understood`` keys sends the config to the
#: meta-model walk.
HARMLESS_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "max_position_embeddings",
        "rms_norm_eps",
        "layer_norm_eps",
        "layer_norm_epsilon",
        "hidden_act",
        "hidden_activation",
        "activation_function",
        "attention_dropout",
        "attn_pdrop",
        "resid_pdrop",
        "embd_pdrop",
        "rope_theta",
        "pretraining_tp",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "cache_implementation",
        "original_max_position_embeddings",
        "router_aux_loss_coef",
        "output_router_logits",
        "router_jitter_noise",
        "norm_topk_prob",
        "rope_local_base_freq",
        "use_bidirectional_attention",
        "n_ctx",
        "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "task_specific_params",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "is_decoder",
        "id2label",
        "label2id",
        "tokenizer_class",
        "max_length",
        "attention_chunk_size",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "layer_types",
        "auto_map",
    }
)

#: RoPE variants the fast path lays out, with the keys transformers requires of each (it refuses a config missing
#: one; the others, e.g. yarn or longrope, have more rules than are worth copying, so they go to the walk).
_ROPE_REQUIRED = {
    "default": frozenset(),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}


@dataclass(frozen=True)
class Family:
    """One model_type: its transformers class names, the config defaults that shape tensors, and its layer."""

    model_type: str
    architecture: str
    layer_class: str
    #: Config fields that shape tensors, with the defaults of the transformers config class.
    defaults: Mapping[str, Any]
    #: The tensors of decoder layer ``i`` as (name below the layer, shape, quantizable).
    layer: Callable[[_Config, int], list[tuple[str, tuple[int, ...], bool]]]
    #: Model keys this family reads beyond ``defaults`` (each handled in its layer or rope function).
    understood: frozenset[str] = frozenset()
    embed_scale: bool = False  # Gemma: a scalar non-persistent buffer in the embedding
    base_prefix: str = "model"
    #: Head dim when the config names none: ``None`` means hidden_size // num_attention_heads.
    head_dim_default: int | None = None
    #: Layer types (Gemma 3): each type present gets its own pair of RoPE buffers.
    rope_per_layer_type: bool = False
    #: Whether ``"head_dim": null`` (as saved configs write it) means hidden_size // num_attention_heads; in the
    #: other families transformers fails on it, so the walk must be the one to say so.
    head_dim_null_derives: bool = False


@dataclass
class _Config:
    """A config dict with the family's defaults filled in, plus the values derived from it."""

    values: dict[str, Any]
    head_dim: int = 0

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def _lin(name: str, out_f: int, in_f: int, bias: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    out = [(f"{name}.weight", (out_f, in_f), True)]
    if bias:
        out.append((f"{name}.bias", (out_f,), False))
    return out


def _norm(name: str, size: int) -> tuple[str, tuple[int, ...], bool]:
    return (f"{name}.weight", (size,), False)


def _attention(c: _Config, q_bias: bool, o_bias: bool, qk_norm: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    h, hd = c["hidden_size"], c.head_dim
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = (
        _lin("self_attn.q_proj", q, h, q_bias)
        + _lin("self_attn.k_proj", kv, h, q_bias)
        + _lin("self_attn.v_proj", kv, h, q_bias)
        + _lin("self_attn.o_proj", h, q, o_bias)
    )
    if qk_norm:
        out += [_norm("self_attn.q_norm", hd), _norm("self_attn.k_norm", hd)]
    return out


def _mlp(prefix: str, hidden: int, inter: int, bias: bool = False) -> list[tuple[str, tuple[int, ...], bool]]:
    return (
        _lin(f"{prefix}.gate_proj", inter, hidden, bias)
        + _lin(f"{prefix}.up_proj", inter, hidden, bias)
        + _lin(f"{prefix}.down_proj", hidden, inter, bias)
    )


def _experts(c: _Config, n: int, inter: int) -> list[tuple[str, tuple[int, ...], bool]]:
    h = c["hidden_size"]
    return [("mlp.experts.gate_up_proj", (n, 2 * inter, h), False), ("mlp.experts.down_proj", (n, h, inter), False)]


def _norms(c: _Config, *names: str) -> list[tuple[str, tuple[int, ...], bool]]:
    return [_norm(n, c["hidden_size"]) for n in names]


_PAIR_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA2_NORMS = _PAIR_NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _flag(c: _Config, flag: bool | str) -> bool:
    return bool(c[flag]) if isinstance(flag, str) else flag


def _dense(
    q_bias: bool | str, o_bias: bool | str, qk_norm: bool, norms: tuple[str, ...], mlp_bias: bool | str = False
) -> Callable[[_Config, int], list[tuple[str, tuple[int, ...], bool]]]:
    """The layer of a dense decoder: attention, gated MLP, then its norms (in the order transformers registers them)."""

    def layer(c: _Config, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
        mlp = _mlp("mlp", c["hidden_size"], c["intermediate_size"], _flag(c, mlp_bias))
        return _attention(c, _flag(c, q_bias), _flag(c, o_bias), qk_norm) + mlp + _norms(c, *norms)

    return layer


def _mixtral_layer(c: _Config, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    n = c["num_local_experts"]
    return (
        _attention(c, False, False, False)
        + [("mlp.gate.weight", (n, c["hidden_size"]), False)]
        + _experts(c, n, c["intermediate_size"])
        + _norms(c, *_PAIR_NORMS)
    )


def _is_sparse(c: _Config, i: int) -> bool:
    """Qwen-MoE: which layers route to experts (the rest have a dense MLP of ``intermediate_size``)."""
    return i not in (c["mlp_only_layers"] or []) and c["num_experts"] > 0 and (i + 1) % c["decoder_sparse_step"] == 0


def _qwen2_moe_layer(c: _Config, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    h = c["hidden_size"]
    out = _attention(c, bool(c["qkv_bias"]), False, False)
    if _is_sparse(c, i):
        n = c["num_experts"]
        out += [("mlp.gate.weight", (n, h), False)] + _experts(c, n, c["moe_intermediate_size"])
        out += _mlp("mlp.shared_expert", h, c["shared_expert_intermediate_size"])
        out += _lin("mlp.shared_expert_gate", 1, h, False)
    else:
        out += _mlp("mlp", h, c["intermediate_size"])
    return out + _norms(c, *_PAIR_NORMS)


def _qwen3_moe_layer(c: _Config, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    h = c["hidden_size"]
    bias = bool(c["attention_bias"])
    out = _attention(c, bias, bias, True)
    if _is_sparse(c, i):
        n = c["num_experts"]
        out += _experts(c, n, c["moe_intermediate_size"]) + [("mlp.gate.weight", (n, h), False)]
    else:
        out += _mlp("mlp", h, c["intermediate_size"])
    return out + _norms(c, *_PAIR_NORMS)


def _phi3_layer(c: _Config, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    h, hd, inter = c["hidden_size"], c.head_dim, c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return (
        _lin("self_attn.o_proj", h, q, False)
        + _lin("self_attn.qkv_proj", q + 2 * kv, h, False)
        + _lin("mlp.gate_up_proj", 2 * inter, h, False)
        + _lin("mlp.down_proj", h, inter, False)
        + _norms(c, *_PAIR_NORMS)
    )


def _gpt2_layer(c: _Config, i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    h = c["n_embd"]
    inner = c["n_inner"] or 4 * h

    def conv1d(name: str, n_in: int, n_out: int) -> list[tuple[str, tuple[int, ...], bool]]:
        return [(f"{name}.weight", (n_in, n_out), True), (f"{name}.bias", (n_out,), False)]

    def layer_norm(name: str) -> list[tuple[str, tuple[int, ...], bool]]:
        return [(f"{name}.weight", (h,), False), (f"{name}.bias", (h,), False)]

    return (
        layer_norm("ln_1")
        + conv1d("attn.c_attn", h, 3 * h)
        + conv1d("attn.c_proj", h, h)
        + layer_norm("ln_2")
        + conv1d("mlp.c_fc", h, inner)
        + conv1d("mlp.c_proj", inner, h)
    )


_DECODER = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    tie_word_embeddings=False,
)
_QWEN_MOE = dict(decoder_sparse_step=1, mlp_only_layers=None, norm_topk_prob=False)

_BIASED = "attention_bias"  # the config key that puts biases on all four attention projections

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            "LlamaDecoderLayer",
            dict(_DECODER, num_key_value_heads=None, attention_bias=False, mlp_bias=False),
            _dense(_BIASED, _BIASED, False, _PAIR_NORMS, "mlp_bias"),
            understood=frozenset({"head_dim"}),
            head_dim_null_derives=True,
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            "MistralDecoderLayer",
            dict(_DECODER, intermediate_size=14336, num_key_value_heads=8),
            _dense(False, False, False, _PAIR_NORMS),
            understood=frozenset({"head_dim"}),
            head_dim_null_derives=True,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "MixtralDecoderLayer",
            dict(_DECODER, intermediate_size=14336, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
            _mixtral_layer,
            understood=frozenset({"head_dim", "num_experts"}),
            head_dim_null_derives=True,
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            "Qwen2DecoderLayer",
            dict(_DECODER, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32),
            _dense(True, False, False, _PAIR_NORMS),
            understood=frozenset({"head_dim"}),
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            "Qwen3DecoderLayer",
            dict(_DECODER, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, attention_bias=False),
            _dense(_BIASED, _BIASED, True, _PAIR_NORMS),
            understood=frozenset({"head_dim"}),
            head_dim_default=128,
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "Qwen2MoeDecoderLayer",
            dict(
                _DECODER,
                **_QWEN_MOE,
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=24,
                num_attention_heads=16,
                num_key_value_heads=16,
                moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632,
                num_experts_per_tok=4,
                num_experts=60,
                qkv_bias=True,
            ),
            _qwen2_moe_layer,
            understood=frozenset({"head_dim"}),
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeDecoderLayer",
            dict(
                _DECODER,
                **_QWEN_MOE,
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=24,
                num_attention_heads=32,
                num_key_value_heads=4,
                moe_intermediate_size=768,
                num_experts_per_tok=8,
                num_experts=128,
                attention_bias=False,
            ),
            _qwen3_moe_layer,
            understood=frozenset({"head_dim"}),
        ),
        Family(
            "gemma",
            "GemmaForCausalLM",
            "GemmaDecoderLayer",
            dict(
                _DECODER,
                vocab_size=256000,
                hidden_size=3072,
                intermediate_size=24576,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=16,
                tie_word_embeddings=True,
                attention_bias=False,
                pad_token_id=0,
            ),
            _dense(_BIASED, _BIASED, False, _PAIR_NORMS),
            understood=frozenset({"head_dim"}),
            embed_scale=True,
            head_dim_default=256,
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            "Gemma2DecoderLayer",
            dict(
                _DECODER,
                vocab_size=256000,
                hidden_size=2304,
                intermediate_size=9216,
                num_hidden_layers=26,
                num_attention_heads=8,
                num_key_value_heads=4,
                tie_word_embeddings=True,
                attention_bias=False,
                pad_token_id=0,
            ),
            _dense(_BIASED, _BIASED, False, _GEMMA2_NORMS),
            understood=frozenset({"head_dim"}),
            embed_scale=True,
            head_dim_default=256,
        ),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            "Gemma3DecoderLayer",
            dict(
                _DECODER,
                vocab_size=262208,
                hidden_size=2304,
                intermediate_size=9216,
                num_hidden_layers=26,
                num_attention_heads=8,
                num_key_value_heads=4,
                tie_word_embeddings=True,
                attention_bias=False,
                pad_token_id=0,
            ),
            _dense(_BIASED, _BIASED, True, _GEMMA2_NORMS),
            understood=frozenset({"head_dim", "sliding_window_pattern"}),
            embed_scale=True,
            head_dim_default=256,
            rope_per_layer_type=True,
        ),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            "Phi3DecoderLayer",
            dict(
                _DECODER,
                vocab_size=32064,
                hidden_size=3072,
                intermediate_size=8192,
                num_key_value_heads=None,
                pad_token_id=32000,
            ),
            _phi3_layer,
            understood=frozenset({"head_dim"}),
        ),
        Family(
            "gpt2",
            "GPT2LMHeadModel",
            "GPT2Block",
            dict(
                vocab_size=50257,
                n_positions=1024,
                n_embd=768,
                n_layer=12,
                n_head=12,
                n_inner=None,
                tie_word_embeddings=True,
                add_cross_attention=False,
            ),
            _gpt2_layer,
            base_prefix="transformer",
        ),
    )
}


def family_of(config: Mapping[str, Any]) -> Family | None:
    """The family a config dict belongs to, by its ``model_type``.

    A config naming only ``architectures`` goes to the walk: transformers resolves a class name to the first
    model_type registered for it (``LlamaForCausalLM`` -> ``exaone``), and that choice is the walk's to make.
    """
    model_type = config.get("model_type")
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def base_model_prefix(model_type: str) -> str | None:
    """The attribute that holds the base model (``model``, ``transformer``) for a family known here."""
    family = FAMILIES.get(model_type)
    return family.base_prefix if family else None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _rope_dims(rope: Any, head_dim: int) -> int | None:
    """Entries of one RoPE's inverse frequencies, or None when this RoPE is one the fast path does not model."""
    if rope is None:
        return (head_dim + 1) // 2
    if not isinstance(rope, Mapping):
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    required = _ROPE_REQUIRED.get(kind) if isinstance(kind, str) else None
    if required is None or not required <= set(rope) or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    return (head_dim + 1) // 2


def _rope_buffers(family: Family, c: _Config, raw: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    """(buffer name, length) of the rotary embedding's buffers, or None to fall back."""
    rope = raw.get("rope_parameters") if raw.get("rope_parameters") is not None else raw.get("rope_scaling")
    if "partial_rotary_factor" in raw:
        return None
    if not family.rope_per_layer_type:
        if isinstance(rope, Mapping) and any(isinstance(v, Mapping) for v in rope.values()):
            return None  # per-layer-type RoPE on a family with one rotary embedding
        n = _rope_dims(rope, c.head_dim)
        return None if n is None else [("inv_freq", n), ("original_inv_freq", n)]
    layers = c["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", 6)
        if not _positive_int(pattern):
            return None
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        return None
    if rope is not None and not (isinstance(rope, Mapping) and set(rope) <= {"sliding_attention", "full_attention"}):
        return None
    out: list[tuple[str, int]] = []
    for kind in sorted(set(types)):
        n = _rope_dims((rope or {}).get(kind), c.head_dim)
        if n is None:
            return None
        out += [(f"{kind}_inv_freq", n), (f"{kind}_original_inv_freq", n)]
    return out


def _resolve(family: Family, raw: Mapping[str, Any]) -> _Config | None:
    """The config's values over the family's defaults, checked as transformers would; None to fall back."""
    unknown = set(raw) - HARMLESS_KEYS - set(family.defaults) - family.understood
    if unknown:
        log.debug("config keys %s are not modelled for %s; walking the meta model", sorted(unknown), family.model_type)
        return None
    values = dict(family.defaults)
    values.update({k: v for k, v in raw.items() if k in family.defaults or k in family.understood})
    gpt2 = family.model_type == "gpt2"
    hidden_key, heads_key, layers_key = (
        ("n_embd", "n_head", "n_layer") if gpt2 else ("hidden_size", "num_attention_heads", "num_hidden_layers")
    )
    if not all(_positive_int(values[k]) for k in ("vocab_size", hidden_key, heads_key, layers_key)):
        return None
    hidden, heads = values[hidden_key], values[heads_key]
    if hidden % heads:
        return None  # transformers refuses it (or builds something odd): let it say which
    if gpt2:
        if values["add_cross_attention"] or not _positive_int(values["n_positions"]):
            return None
        if values["n_inner"] is not None and not _positive_int(values["n_inner"]):
            return None
        return _Config(values, head_dim=hidden // heads)
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    kv_heads = values["num_key_value_heads"]
    if not _positive_int(kv_heads) or heads % kv_heads or not _positive_int(values["intermediate_size"]):
        return None
    head_dim = raw.get("head_dim") if "head_dim" in raw else family.head_dim_default
    if head_dim is None and ("head_dim" not in raw or family.head_dim_null_derives):
        head_dim = hidden // heads
    if not _positive_int(head_dim):
        return None
    values["head_dim"] = head_dim
    pad = raw.get("pad_token_id", values.get("pad_token_id"))
    if pad is not None and (not isinstance(pad, int) or not -values["vocab_size"] <= pad < values["vocab_size"]):
        return None  # nn.Embedding would refuse the padding index
    for key in (
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "decoder_sparse_step",
    ):
        if key in values and not _positive_int(values[key]):
            return None
    only = values.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(isinstance(i, int) for i in only)):
        return None
    if "num_experts" in raw and family.model_type == "mixtral":
        values["num_local_experts"] = raw["num_experts"]
    return _Config(values, head_dim=head_dim)


def _dtype_of(raw: Mapping[str, Any]) -> str | None:
    """The model's default dtype (:func:`default_dtype`, the one rule), or None when the config names a dtype this
    fast path does not follow (the meta walk then handles it)."""
    value = raw.get("dtype", raw.get("torch_dtype"))
    if value is not None and dtype_name(value) not in ("float32", "float16", "bfloat16"):
        return None
    return default_dtype(value)


_SLIDING_KEYS = ("sliding_window", "use_sliding_window", "layer_types", "sliding_window_pattern", "max_window_layers")


def config_skeleton(config: Mapping[str, Any], *, name: str | None = None) -> Skeleton | None:
    """The Skeleton of the causal LM ``config`` describes, or None when this family or config is not modelled here.

    Equal, field by field, to ``skeleton_from_model`` on the meta model transformers would build from it. ``name``
    defaults as the walk's does: the config's ``_name_or_path``, else its model_type.
    """
    family = family_of(config)
    if family is None:
        return None
    name = name or str(config.get("_name_or_path") or family.model_type)
    c = _resolve(family, config)
    dtype = _dtype_of(config)
    if c is None or dtype is None:
        return None
    rope = None if family.model_type == "gpt2" else _rope_buffers(family, c, config)
    if rope is None and family.model_type != "gpt2":
        return None
    tied = bool(c["tie_word_embeddings"])
    gpt2 = family.model_type == "gpt2"
    hidden = c["n_embd"] if gpt2 else c["hidden_size"]
    vocab = c["vocab_size"]
    base = family.base_prefix

    def params(prefix: str, specs: list[tuple[str, tuple[int, ...], bool]]) -> tuple[TensorSpec, ...]:
        # GPT-2's linear layers are Conv1D ([in, out]), which bitsandbytes replaces and cpu_quantization does not
        return tuple(TensorSpec(f"{prefix}.{n}", shape, dtype, "parameter", q, q and not gpt2) for n, shape, q in specs)

    embed_name = f"{base}.wte" if gpt2 else f"{base}.embed_tokens"
    embed = [TensorSpec(f"{embed_name}.weight", (vocab, hidden), dtype, "parameter", False)]
    if family.embed_scale:
        embed.append(TensorSpec(f"{embed_name}.embed_scale", (), dtype, "buffer_nonpersistent", False))
    blocks = [Block(embed_name, tuple(embed), is_embedding=True)]
    if gpt2:
        blocks.append(
            Block(
                f"{base}.wpe", params(f"{base}.wpe", [("weight", (c["n_positions"], hidden), False)]), is_embedding=True
            )
        )
    layer_root = f"{base}.h" if gpt2 else f"{base}.layers"
    n_layers = c["n_layer"] if gpt2 else c["num_hidden_layers"]
    for i in range(n_layers):
        blocks.append(
            Block(f"{layer_root}.{i}", params(f"{layer_root}.{i}", family.layer(c, i)), no_split=True, layer_index=i)
        )
    if gpt2:
        blocks.append(
            Block(f"{base}.ln_f", params(f"{base}.ln_f", [("weight", (hidden,), False), ("bias", (hidden,), False)]))
        )
    else:
        blocks.append(Block(f"{base}.norm", params(f"{base}.norm", [("weight", (hidden,), False)])))
        blocks.append(
            Block(
                f"{base}.rotary_emb",
                tuple(
                    TensorSpec(f"{base}.rotary_emb.{n}", (length,), "float32", "buffer_nonpersistent", False)
                    for n, length in rope or ()
                ),
            )
        )
    head = () if tied else (TensorSpec("lm_head.weight", (vocab, hidden), dtype, "parameter", False),)
    blocks.append(Block("lm_head", head, is_head=True))
    geometry = dict(c.values)
    if gpt2:
        geometry.pop("head_dim", None)
    # what the KV cache keeps per layer follows the raw config (and the class's default window), as the walk sees it
    geometry.update({k: config[k] for k in _SLIDING_KEYS if k in config})
    geometry.setdefault("sliding_window", SLIDING_DEFAULTS.get(family.model_type))
    geometry["model_type"] = family.model_type
    return Skeleton(
        name=name,
        architecture=family.architecture,
        model_type=family.model_type,
        blocks=tuple(blocks),
        tied_groups=((f"{embed_name}.weight", "lm_head.weight"),) if tied else (),
        no_split_classes=(family.layer_class,),
        kv=kv_geometry(geometry, n_layers),
        default_dtype=dtype,
        **model_sizes(geometry),
    )


def config_file_name(path: Path) -> str:
    """A skeleton's default name for a config file: its directory's name for ``config.json``, else its stem."""
    return path.parent.name if path.name == CONFIG_NAME else path.stem
