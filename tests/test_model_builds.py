"""The shared fixtures are real, sharded, offline-loadable checkpoints with the properties tests rely on."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from service.model import random_models
from service.model.build_folders import MARKER_NAME
from service.model.corpus_tokenizer import make_tokenizer
from service.model.demo_model import greedy_sample
from service.model.random_models import build_model
from tests import models


def checkpoint_keys(model_dir: Path) -> set[str]:
    """Every tensor name stored in the directory's safetensors shards, read from the headers."""
    keys: set[str] = set()
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            keys.update(f.keys())
    return keys


def shard_digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.glob("*.safetensors"))}


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gpt2", "tiny_moe"])
def any_model(request) -> Path:
    return request.getfixturevalue(request.param)


def test_fixture_is_a_sharded_checkpoint_with_a_complete_index(any_model: Path):
    index = json.loads((any_model / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert shards == {p.name for p in any_model.glob("*.safetensors")}
    assert set(index["weight_map"]) == checkpoint_keys(any_model)


def test_fixture_loads_offline_with_plain_transformers(any_model: Path):
    tokenizer = AutoTokenizer.from_pretrained(any_model)
    model = AutoModelForCausalLM.from_pretrained(any_model)
    config = model.config
    assert config.vocab_size >= len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert config.num_hidden_layers >= 4
    inputs = tokenizer(["The fox ran", "We hold"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (2, inputs["input_ids"].shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


def test_llama_has_grouped_query_attention_and_an_untied_head(tiny_llama: Path):
    config = AutoConfig.from_pretrained(tiny_llama)
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.tie_word_embeddings is False
    keys = checkpoint_keys(tiny_llama)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= keys
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    k_rows = model.model.layers[0].self_attn.k_proj.weight.shape[0]
    q_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    assert k_rows * config.num_attention_heads == q_rows * config.num_key_value_heads
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.all_tied_weights_keys == {}


def test_gpt2_ties_its_head_to_the_token_embedding(tiny_gpt2: Path):
    assert "lm_head.weight" not in checkpoint_keys(tiny_gpt2)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    assert model.config.tie_word_embeddings is True
    assert model.all_tied_weights_keys == {"lm_head.weight": "transformer.wte.weight"}
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_mixtral_stores_per_expert_weights_and_routes_top_2(tiny_moe: Path):
    config = AutoConfig.from_pretrained(tiny_moe)
    assert config.num_local_experts >= 4 and config.num_experts_per_tok == 2
    keys = checkpoint_keys(tiny_moe)
    for expert in range(config.num_local_experts):
        assert f"model.layers.0.block_sparse_moe.experts.{expert}.w1.weight" in keys
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == config.num_local_experts


def test_same_seed_gives_same_bytes_and_another_seed_does_not(tmp_path: Path, tiny_llama: Path):
    again = build_model("llama", tmp_path / "again", seed=0)
    other = build_model("llama", tmp_path / "other", seed=1)
    assert shard_digests(again) == shard_digests(tiny_llama)
    assert shard_digests(other) != shard_digests(tiny_llama)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_fast_instantiation_matches_a_normally_constructed_model(kind: str):
    config = random_models.make_config(kind, random_models.MODEL_SPECS[(kind, "tiny")], make_tokenizer(), "float32")
    fast = random_models.instantiate(config, "float32", seed=0)
    normal = AutoModelForCausalLM.from_config(config)
    assert dict(fast.named_buffers()).keys() == dict(normal.named_buffers()).keys()
    for name, buffer in normal.named_buffers():
        assert torch.equal(dict(fast.named_buffers())[name], buffer), name
    assert fast.state_dict().keys() == normal.state_dict().keys()
    assert fast.all_tied_weights_keys == normal.all_tied_weights_keys


def test_a_complete_build_is_reused_and_foreign_folders_are_refused(tmp_path: Path):
    out = build_model("gpt2", tmp_path / "m", max_shard_size="300KB")
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert build_model("gpt2", out, max_shard_size="300KB") == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert not list(tmp_path.glob(".m.tmp-*")), "temporary build folders must not be left behind"

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not built by loadmaster"):
        build_model("gpt2", foreign)
    with pytest.raises(ValueError, match="known recipes"):
        build_model("gpt2", tmp_path / "x", size="1b")


def test_two_processes_building_the_same_folder_both_get_a_complete_build(tmp_path: Path):
    out = tmp_path / "shared"
    code = f"from service.model.random_models import build_model; print(build_model('gpt2', {str(out)!r}))"
    repo = Path(__file__).resolve().parent.parent
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert all(stdout.strip() == str(out) for stdout, _ in results)
    assert [p.name for p in tmp_path.iterdir()] == ["shared"], "no temporary folders may remain"
    assert shard_digests(out) == shard_digests(build_model("gpt2", tmp_path / "solo"))


@pytest.mark.parametrize(("size", "low", "high"), [("100m", 90e6, 120e6), ("300m", 270e6, 340e6), ("1b", 0.9e9, 1.2e9)])
def test_benchmark_recipes_have_their_advertised_size(size: str, low: float, high: float):
    config = random_models.make_config(
        "llama", random_models.MODEL_SPECS[("llama", size)], make_tokenizer(), "bfloat16"
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert low <= sum(p.numel() for p in model.parameters()) <= high
    assert config.num_key_value_heads < config.num_attention_heads


@pytest.mark.parametrize(
    "text",
    ["Slow and steady wins the race.", "  two  spaces\nand a newline\t tab", "café naïve — 🦊 über ¿qué?", ""],
)
def test_tokenizer_round_trips_text(text: str):
    tokenizer = make_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_is_deterministic_and_has_the_specials_and_a_chat_template():
    first, second = make_tokenizer(), make_tokenizer()
    assert first.get_vocab() == second.get_vocab()
    assert 512 <= len(first) <= 2000
    assert first.convert_ids_to_tokens([first.bos_token_id, first.eos_token_id, first.pad_token_id]) == [
        "<s>",
        "</s>",
        "<pad>",
    ]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who won the race?"},
        {"role": "assistant", "content": "The tortoise."},
    ]
    rendered = first.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for message in chat:
        assert message["content"] in rendered
    assert rendered.startswith("<s>") and rendered.count("</s>") == 3
    assert rendered.endswith("### assistant:\n")


def test_demo_model_learns_and_writes_printable_text():
    path = models.demo_model_dir()
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["last_loss"] < marker["first_loss"]
    text = greedy_sample(path, "The lion", max_new_tokens=16)
    assert text.strip()
    assert all(ch.isprintable() or ch in "\n\t" for ch in text), repr(text)
