"""The one place tests get their models from.

Each function builds its model once into a cache folder and returns the folder on later calls (and in
later runs). The cache is ``$LOADMASTER_TEST_CACHE`` or ``<repo>/.cache/test-models`` (git-ignored).
Builds are atomic, so two processes asking at once both end up with the same complete folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from service.model.corpus_tokenizer import make_tokenizer, tokenizer_fingerprint
from service.model.demo_model import build_demo_model
from service.model.random_models import build_model

REPO_ROOT = Path(__file__).resolve().parent.parent

# A quick demo-model variant for tests: same architecture and tokenizer, far fewer training steps.
TEST_DEMO_STEPS = 12


def cache_dir() -> Path:
    """Folder holding every cached test model."""
    return Path(os.environ.get("LOADMASTER_TEST_CACHE") or REPO_ROOT / ".cache" / "test-models")


def tiny_llama_dir() -> Path:
    """Llama, 4 layers, grouped-query attention (4 query / 2 KV heads), untied head; ~1 MB fp32, sharded."""
    return build_model("llama", cache_dir() / "tiny-llama", size="tiny")


def tiny_draft_llama_dir() -> Path:
    """Llama, 1 layer of width 32, the tiny Llama's tokenizer: a ``--draft-model`` for it (~0.2 MB fp32, sharded)."""
    return build_model("llama", cache_dir() / "tiny-draft-llama", size="draft")


def tiny_gpt2_dir() -> Path:
    """GPT-2, 4 layers, lm_head tied to transformer.wte; ~1.5 MB fp32, sharded."""
    return build_model("gpt2", cache_dir() / "tiny-gpt2", size="tiny")


def tiny_moe_dir() -> Path:
    """Mixtral, 4 layers, 4 experts with top-2 routing; ~1.5 MB fp32, sharded (per-expert keys on disk)."""
    return build_model("mixtral", cache_dir() / "tiny-mixtral", size="tiny")


def tiny_gpt_oss_dir() -> Path:
    """gpt-oss, 4 layers alternating sliding and full attention (with sinks), 4 experts with top-2 routing; fp32,
    sharded: the layout gpt-oss's MXFP4 experts are written from."""
    return build_model("gpt_oss", cache_dir() / "tiny-gpt-oss", size="tiny")


def tiny_qwen_moe_dir() -> Path:
    """Qwen2-MoE, 4 layers, 8 routed experts with top-2 routing and a gated shared expert; fp32, sharded."""
    return build_model("qwen2_moe", cache_dir() / "tiny-qwen-moe", size="tiny")


def llama_100m_dir(dtype: str = "float32") -> Path:
    """Llama with ~105M parameters (benchmarks only; a few seconds to build, ~420 MB in fp32)."""
    return build_model("llama", cache_dir() / f"llama-100m-{dtype}", size="100m", dtype=dtype)


def llama_300m_dir(dtype: str = "float32") -> Path:
    """Llama with ~300M parameters (~1.2 GB in fp32): the Docker smoke test's model bigger than its container."""
    return build_model("llama", cache_dir() / f"llama-300m-{dtype}", size="300m", dtype=dtype)


def llama_1b_dir(dtype: str = "bfloat16") -> Path:
    """Llama with ~1B parameters in >= 4 shards (benchmarks only; ~2 GB in bf16, ~4 GB in fp32)."""
    return build_model("llama", cache_dir() / f"llama-1b-{dtype}", size="1b", dtype=dtype)


def chat_model_dir(family: str) -> Path:
    """The tiny Llama with the chat template of ``family`` (:data:`tests.chat_templates.TEMPLATES`: Qwen2.5's
    Hermes tool calls, Qwen3's thinking, Llama 3.1's JSON calls, Mistral's [TOOL_CALLS]; ``harmony``: gpt-oss's
    channels, :func:`harmony_model_dir`), in its own folder."""
    import shutil

    if family == "harmony":
        return harmony_model_dir()

    from tests.chat_templates import TEMPLATES

    source = tiny_llama_dir()
    out = cache_dir() / f"tiny-llama-chat-{family}"
    template = TEMPLATES[family]
    marker = out / "chat_template.jinja"
    if marker.exists() and marker.read_text() == template:
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    (tmp / "chat_template.jinja").write_text(template)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def harmony_model_dir() -> Path:
    """A tiny Llama that speaks gpt-oss's harmony format: its tokenizer holds harmony's markers as special tokens
    (the vocabulary, and so the embeddings, grown by them), its chat template is shaped like gpt-oss's
    (:data:`tests.chat_templates.GPT_OSS`), and ``<|return|>`` and ``<|call|>`` end a turn, as in gpt-oss's
    generation config."""
    import shutil

    from tokenizers import AddedToken
    from transformers import GenerationConfig

    from service.model.random_models import (
        MODEL_SPECS,
        default_shard_size,
        instantiate,
        make_config,
        save_checkpoint,
        transformers_version,
    )
    from tests.chat_templates import GPT_OSS, HARMONY_TOKENS

    out = cache_dir() / "tiny-llama-harmony"
    recipe = f"{tokenizer_fingerprint()} {transformers_version()} {HARMONY_TOKENS}\n{GPT_OSS}"
    marker = out / "harmony_build.txt"  # a changed tokenizer, transformers or template builds it again
    if marker.exists() and marker.read_text() == recipe:
        return out
    tokenizer = make_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS], special_tokens=True)
    model = instantiate(make_config("llama", MODEL_SPECS[("llama", "tiny")], tokenizer, "float32"), "float32", 0)
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[*ends, tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tokenizer, tmp, default_shard_size(model, 3))
    (tmp / "chat_template.jinja").write_text(GPT_OSS)
    (tmp / "harmony_build.txt").write_text(recipe)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def demo_model_dir() -> Path:
    """A briefly trained demo-architecture Llama (few steps) for tests that want text-like behaviour."""
    return build_demo_model(cache_dir() / "demo-quick", steps=TEST_DEMO_STEPS)
