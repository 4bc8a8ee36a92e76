"""What a transformers ``config.json`` says that the planner needs, read without transformers or torch.

Both skeleton builders use these: the meta-model walk (``meta_skeleton.py``) reads them off a ``PretrainedConfig``, the
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
    values, layout = _latent_kv(cfg)
    sliding, window = _sliding_layers(cfg, int(layers))
    return KVGeometry(
        num_layers=int(layers),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        values_per_token=values,
        sliding_layers=sliding,
        sliding_window=window,
        layout=layout,
    )


def _latent_kv(cfg: Any) -> tuple[int, str]:
    """Multi-head latent attention (DeepSeek-V2/V3, ``kv_lora_rank``): transformers 5's attention caches the
    compressed latent (``kv_lora_rank``) and the shared rotary key (``qk_rope_head_dim``) once per token, not K and
    V per head (tests/planner check this against the cache a small DeepSeek-V3 really fills)."""
    rank, rope = config_value(cfg, "kv_lora_rank"), config_value(cfg, "qk_rope_head_dim")
    if not isinstance(rank, int) or not isinstance(rope, int) or rank <= 0:
        return 0, ""
    heads = config_value(cfg, "num_attention_heads") or 0
    nope, v = config_value(cfg, "qk_nope_head_dim") or 0, config_value(cfg, "v_head_dim") or 0
    expanded = int(heads) * (int(nope) + int(rope) + int(v))
    return rank + rope, (
        f"multi-head latent attention: the KV cache holds the compressed latent (kv_lora_rank {rank} + "
        f"qk_rope_head_dim {rope} = {rank + rope} values per token per layer), as transformers' implementation "
        f"stores it, not per-head K and V ({expanded} values)"
    )


def _sliding_layers(cfg: Any, layers: int) -> tuple[tuple[int, ...], int]:
    """(layers attending within a sliding window, the window), as transformers' caches decide: ``layer_types``
    where the config has them; else every layer when ``sliding_window`` is set (Mistral-style) and not switched
    off by ``use_sliding_window``. A config dict without ``layer_types`` whose family derives them (Gemma-2's
    alternation) gets the family's derived pattern."""
    window = config_value(cfg, "sliding_window")
    use = config_value(cfg, "use_sliding_window")
    if not isinstance(window, int) or window <= 0 or use is False:
        return (), 0
    if not use and str(config_value(cfg, "model_type")) in _SLIDING_FROM:  # Qwen: off unless switched on
        return (), 0
    types = config_value(cfg, "layer_types")
    if types is None and isinstance(cfg, Mapping) and cfg.get("model_type"):
        types = _derived_layer_types(dict(cfg))
    if isinstance(types, (list, tuple)) and len(types) == layers:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention"), int(window)
    return tuple(range(layers)), int(window)


#: Families whose config classes derive ``layer_types`` when a config leaves them out: sliding every layer whose
#: ``(i + 1) % pattern`` is not 0 (pattern: the ``sliding_window_pattern`` key, else the default).
_SLIDING_PATTERNS = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6}
#: Families that slide from layer ``max_window_layers`` on when ``use_sliding_window`` is set.
_SLIDING_FROM = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
#: ``sliding_window`` of the config classes that set one when a config leaves it out.
SLIDING_DEFAULTS = {
    "mistral": 4096,
    "gemma2": 4096,
    "gemma3_text": 4096,
    "gemma3": 4096,
    **dict.fromkeys(_SLIDING_FROM, 4096),  # used only where use_sliding_window switches it on
}


def _derived_layer_types(doc: dict) -> list[str] | None:
    """``layer_types`` as the family's transformers config class derives them (None when it keeps all sliding).
    Plain data: the planner core imports no transformers; tests/planner compare with the real caches."""
    model_type = str(doc.get("model_type"))
    n = int(doc.get("num_hidden_layers") or 0)
    if model_type in _SLIDING_FROM:
        first = doc.get("max_window_layers")
        first = first if isinstance(first, int) else 0
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    pattern = _SLIDING_PATTERNS.get(model_type)
    if pattern is None:
        return None
    if model_type != "gemma2":
        pattern = doc.get("sliding_window_pattern", pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


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
