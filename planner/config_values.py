"""What a transformers ``config.json`` says that the planner needs, read without transformers or torch.

Both skeleton builders use these: the meta-model walk (``skeleton.py``) reads them off a ``PretrainedConfig``, the
config-only builder (``config_skeleton.py``) off a plain dict with the family's defaults filled in. One reading of
each value, so the two builders cannot disagree about the KV cache or the model's sizes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.errors import ModelSourceError
from planner.types import DTYPE_BYTES, KVGeometry

CONFIG_NAME = "config.json"


def read_config_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelSourceError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelSourceError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ModelSourceError(f"{path}: expected a JSON object (a transformers config), got {type(doc).__name__}")
    return doc


def config_value(cfg: Any, *names: str) -> Any:
    """The first of ``names`` the config sets. Instance attributes are read directly: transformers' config
    ``__getattribute__`` is slow on misses, so ``getattr`` is kept for aliases (``attribute_map``) and class-level
    properties, the only other places a value can come from."""
    if isinstance(cfg, Mapping):
        for n in names:
            v = cfg.get(n)
            if v is not None:
                return v
        return None
    own = vars(cfg) if hasattr(cfg, "__dict__") else {}
    for n in names:
        v = own.get(n)
        if v is not None:
            return v
    cls = type(cfg)
    aliases = getattr(cls, "attribute_map", None) or {}
    for n in names:
        if n in aliases or hasattr(cls, n):
            v = getattr(cfg, n, None)
            if v is not None:
                return v
    return None


def text_config(cfg: Any) -> Any:
    if not isinstance(cfg, Mapping) and hasattr(cfg, "gettext_config"):
        try:
            return cfg.gettext_config()
        except Exception:  # noqa: BLE001 - a config without a text part is its own text config
            return cfg
    return cfg


def dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    s = str(dtype).replace("torch.", "")
    return s if s in DTYPE_BYTES else None


def default_dtype(config_dtype: Any, stored_dtypes: Any = ()) -> str:
    """The dtype a model runs in when the user names none: the one definition, for the planner and the loader.

    The config's ``dtype`` (``torch_dtype``) when it names one, as transformers' ``dtype="auto"`` does; else the
    most common floating dtype among the stored tensors (``stored_dtypes``: one dtype name per tensor); else
    float32.
    """
    named = dtype_name(config_dtype)
    if named is not None:
        return named
    floats = Counter(d for d in stored_dtypes if str(d).startswith(("float", "bfloat")))
    return floats.most_common(1)[0][0] if floats else "float32"


def kv_geometry(cfg: Any, num_layers: int | None = None) -> KVGeometry | None:
    """KV-cache geometry from a config object or dict: layers, KV heads (GQA/MQA aware) and head dim."""
    cfg = text_config(cfg)
    heads = config_value(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    hidden = config_value(cfg, "hidden_size", "n_embd", "d_model", "dim")
    layers = config_value(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers") or num_layers
    if not heads or not layers:
        return None
    model_type = config_value(cfg, "model_type") or ""
    if str(model_type).startswith("falcon") and config_value(cfg, "new_decoder_architecture") is not None:
        if config_value(cfg, "new_decoder_architecture"):
            kv_heads = config_value(cfg, "num_kv_heads") or heads
        else:
            kv_heads = 1 if config_value(cfg, "multi_query") else heads
    else:
        kv_heads = config_value(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
        if kv_heads is None:
            kv_heads = 1 if config_value(cfg, "multi_query") else heads
    head_dim = config_value(cfg, "head_dim")
    if not isinstance(head_dim, int) or head_dim <= 0:
        if not hidden:
            return None
        head_dim = int(hidden) // int(heads)
    return KVGeometry(num_layers=int(layers), num_kv_heads=int(kv_heads), head_dim=int(head_dim))


def model_sizes(cfg: Any) -> dict[str, int]:
    """vocab/hidden/intermediate/heads/experts per token. For MoE, ``intermediate_size`` is what one token
    activates: ``num_experts_per_tok x per-expert size`` plus any shared expert(s)."""
    cfg = text_config(cfg)
    hidden = int(config_value(cfg, "hidden_size", "n_embd", "d_model") or 0)
    inter = config_value(cfg, "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim")
    if not inter and hidden:
        inter = 4 * hidden  # GPT-2 / Falcon convention when the config leaves it implicit
    n_experts = config_value(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    top_k = config_value(cfg, "num_experts_per_tok", "top_k", "moe_topk")
    if n_experts and top_k:
        per_expert = config_value(cfg, "moe_intermediate_size") or inter or 0
        shared = config_value(cfg, "shared_expert_intermediate_size") or 0
        if not shared and config_value(cfg, "n_shared_experts"):
            shared = int(config_value(cfg, "n_shared_experts")) * int(per_expert)
        inter = int(top_k) * int(per_expert) + int(shared)
    return {
        "vocab_size": int(config_value(cfg, "vocab_size") or 0),
        "hidden_size": hidden,
        "intermediate_size": int(inter or 0),
        "num_attention_heads": int(config_value(cfg, "num_attention_heads", "n_head", "num_heads") or 0),
        "experts_per_token": int(top_k) if n_experts and top_k else 0,
    }
