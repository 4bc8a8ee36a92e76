"""Random-weight checkpoints of real transformers classes, built offline from named recipes.

Models are real transformers classes (Llama, GPT-2, Mixtral) with weights from a fixed seed, saved by
``save_pretrained`` as *sharded* safetensors with an index, exactly as a downloaded checkpoint would look, with the
shared tokenizer (:mod:`service.model.corpus_tokenizer`). The "tiny" recipes are what the tests load; "100m" and "1b"
are the benchmarks' models; "300m" is the Docker smoke test's model bigger than its container. Builds go through
:mod:`service.model.build_folders`: atomic, and reused when already complete. The demo model
(:mod:`service.model.demo_model`) starts from :func:`instantiate` and trains.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import time
from pathlib import Path
from typing import Any

from service.model.build_folders import BUILD_FORMAT, atomic_build_dir, check_target, is_complete, write_marker
from service.model.corpus_tokenizer import make_tokenizer, padded_vocab_size, tokenizer_fingerprint

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")

# Architecture sizes per (kind, size). Kept as plain kwargs so a reader sees the whole model at a glance.
MODEL_SPECS: dict[tuple[str, str], dict[str, Any]] = {
    ("llama", "tiny"): dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
    # a draft for the tiny Llama (same tokenizer, one small layer): speculative decoding's --draft-model tests
    ("llama", "draft"): dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
    ),
    ("llama", "100m"): dict(
        hidden_size=768,
        intermediate_size=2560,
        num_hidden_layers=14,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    # bigger than a small container: the Docker smoke test serves it in a box smaller than its 1.2 GB in fp32
    ("llama", "300m"): dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    ("llama", "1b"): dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    ("gpt2", "tiny"): dict(n_embd=64, n_layer=4, n_head=4, n_positions=1024),
    ("mixtral", "tiny"): dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
    ),
    ("mixtral", "bench"): dict(  # Mixtral's routing (8 experts, top 2) at widths of 1024
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    ),
    ("gpt_oss", "tiny"): dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=131072,  # 32 x 4096: gpt-oss's YaRN factor over its original context
    ),
    ("gpt_oss", "bench"): dict(  # gpt-oss-20b's shape scaled down: 32 experts, top 4, widths of 1024
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
    ),
    ("qwen2_moe", "tiny"): dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=1024,
    ),
}

# How many shards a default build aims for: even tiny models must exercise the sharded-index path.
TARGET_SHARDS = {"tiny": 3, "draft": 2, "100m": 4, "300m": 4, "1b": 5, "bench": 4}


def transformers_version() -> str:
    """Recorded in build markers (read from metadata, so a cache hit never imports transformers)."""
    return importlib.metadata.version("transformers")


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def make_config(kind: str, spec: dict[str, Any], tokenizer, dtype: str):
    """The transformers config for ``kind`` with vocab and special-token ids taken from the tokenizer."""
    from transformers import GPT2Config, GptOssConfig, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vocab = padded_vocab_size(len(tokenizer))
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **ids, **spec)
    elif kind == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, tie_word_embeddings=True, **ids, **spec)
    elif kind == "mixtral":
        cfg = MixtralConfig(vocab_size=vocab, tie_word_embeddings=False, **ids, **spec)
    elif kind == "gpt_oss":
        cfg = GptOssConfig(vocab_size=vocab, tie_word_embeddings=False, **ids, **spec)
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(vocab_size=vocab, tie_word_embeddings=False, **ids, **spec)
    else:  # pragma: no cover - callers validate kind first
        raise ValueError(kind)
    cfg.dtype = dtype
    return cfg


def _init_weights_(model, seed: int, std: float = 0.02) -> None:
    """Fill every parameter in place from one seeded generator: fast, and byte-identical for a seed.

    Norm scales (1-D weights) become ones, biases zeros, everything else N(0, std). Walking
    ``named_parameters`` in order (tied weights appear once) makes the result independent of how
    transformers would have initialised the model.
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)


def _fix_buffers_(model) -> None:
    """Recompute the buffers (rotary frequencies) that ``to_empty`` left as uninitialised memory.

    Each buffer-owning module is rebuilt from its config on the CPU and its buffers copied over; a
    module that cannot be rebuilt that way is an error rather than silently carrying garbage.
    """
    import torch

    for name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise RuntimeError(
                f"cannot initialise buffers {sorted(own)} of {name or 'the model'} ({type(module).__name__}); "
                "random_models only knows config-built buffer modules such as rotary embeddings"
            )
        with torch.device("cpu"):
            fresh = type(module)(config)
        with torch.no_grad():
            for key, buf in own.items():
                buf.copy_(getattr(fresh, key))
        for attr, value in vars(fresh).items():  # plain attributes computed with the buffers (e.g. scaling)
            if not attr.startswith("_") and isinstance(value, (int, float)):
                setattr(module, attr, value)


def instantiate(config, dtype: str, seed: int):
    """Build the model on the meta device, allocate it on the CPU and fill it: no slow default init."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    # to_empty gives shared parameters separate storage; re-tie before filling so tied weights stay one tensor.
    model = model.to_empty(device="cpu")
    model.tie_weights()
    _init_weights_(model, seed)
    _fix_buffers_(model)
    model.eval()
    return model


def set_generation_ids(model, tokenizer) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def default_shard_size(model, target_shards: int) -> int:
    """Bytes per shard so the checkpoint splits into about ``target_shards`` files."""
    sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]
    return max(max(sizes), math.ceil(sum(sizes) / target_shards))


def save_checkpoint(model, tokenizer, directory: Path, max_shard_size: str | int) -> None:
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(directory)
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        raise RuntimeError(
            f"save_pretrained wrote a single file in {directory}; pass a smaller max_shard_size "
            "so the checkpoint is sharded"
        )


def build_model(
    kind: str,
    out_dir: str | Path,
    *,
    size: str = "tiny",
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | int | None = None,
) -> Path:
    """Build a random-weight model of ``kind`` ("llama", "gpt2", "mixtral", "gpt_oss", "qwen2_moe") into ``out_dir`` and return it.

    The folder holds sharded safetensors with ``model.safetensors.index.json``, ``config.json``,
    ``generation_config.json`` and the tokenizer, loadable by plain ``from_pretrained``. The same
    arguments always give the same bytes; a folder already holding that build is returned untouched.
    Sizes: "tiny" for every kind; "draft" (a one-layer draft for the tiny one), "100m", "300m" and "1b" for "llama";
    "bench" for "gpt_oss" (0.83B parameters, 0.12B of them read per token) and "mixtral".
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if (kind, size) not in MODEL_SPECS:
        known = ", ".join(f"{k}/{s}" for k, s in MODEL_SPECS)
        raise ValueError(f"no model recipe for kind={kind!r} size={size!r}; known recipes: {known}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    recipe = dict(
        format=BUILD_FORMAT,
        kind=kind,
        size=size,
        dtype=dtype,
        seed=seed,
        max_shard_size=max_shard_size,
        tokenizer=tokenizer_fingerprint(),
        transformers=transformers_version(),
    )
    if is_complete(out_dir, recipe):
        return out_dir
    check_target(out_dir)

    started = time.perf_counter()
    logger.info("building %s/%s (%s, seed %d) into %s", kind, size, dtype, seed, out_dir)
    tokenizer = make_tokenizer()
    config = make_config(kind, MODEL_SPECS[(kind, size)], tokenizer, dtype)
    with atomic_build_dir(out_dir) as tmp:
        model = instantiate(config, dtype, seed)
        set_generation_ids(model, tokenizer)
        shard = max_shard_size or default_shard_size(model, TARGET_SHARDS.get(size, 3))
        n_params = sum(p.numel() for p in model.parameters())
        save_checkpoint(model, tokenizer, tmp, shard)
        del model
        write_marker(tmp, recipe, parameters=n_params)
    logger.info("built %s/%s: %.1fM parameters in %.1f s", kind, size, n_params / 1e6, time.perf_counter() - started)
    return out_dir
