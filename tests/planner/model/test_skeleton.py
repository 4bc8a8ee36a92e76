"""Skeletons of real checkpoints and configs, checked against what transformers itself builds and loads."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM

from planner.errors import ModelSourceError
from planner.model.safetensors_header import read_checkpoint_headers
from planner.model.skeleton import (
    load_skeleton,
    skeleton_from_config,
    skeleton_from_dir,
    skeleton_from_model,
)
from planner.types import DTYPE_BYTES, Skeleton
from tests.sparse_checkpoint import write_sparse_checkpoint

SKELETON_LOG = "planner.model.skeleton"


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _tensor_map(skel: Skeleton) -> dict[str, tuple[tuple[int, ...], str, str]]:
    names = [t.name for t in skel.tensors()]
    assert len(names) == len(set(names)), "a tensor appears in two blocks"
    return {t.name: (t.shape, t.dtype, t.kind) for t in skel.tensors()}


def _loaded(d: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(d, dtype="auto").eval()


def _assert_matches_loaded_model(skel: Skeleton, model: nn.Module) -> None:
    """Every tensor of the loaded model is in the skeleton once (or is an alias in a tied group), same shape/dtype."""
    tensors = _tensor_map(skel)
    aliases = {a: g[0] for g in skel.tied_groups for a in g[1:]}
    seen = set()
    everything = list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )
    for n, t in everything:
        n = aliases.get(n, n)
        assert n in tensors, f"{n} is missing from the skeleton"
        shape, dtype, _ = tensors[n]
        assert shape == tuple(t.shape) and dtype == str(t.dtype).replace("torch.", ""), n
        seen.add(n)
    assert seen == set(tensors), f"skeleton has tensors the model lacks: {set(tensors) - seen}"


# ------------------------------------------------------------------------------------------------ Llama


def test_llama_dir_names_are_checkpoint_keys_and_module_names(tiny_llama):
    skel = skeleton_from_dir(tiny_llama)
    ck = read_checkpoint_headers(tiny_llama)
    tensors = _tensor_map(skel)
    stored = {n for n, (_, _, kind) in tensors.items() if kind != "buffer_nonpersistent"}
    assert stored == set(ck.tensors)
    for name, h in ck.tensors.items():
        assert tensors[name][:2] == (h.shape, h.dtype)
    assert skel.checkpoint_keys == {}
    _assert_matches_loaded_model(skel, _loaded(tiny_llama))


def test_llama_blocks_order_flags_and_geometry(tiny_llama):
    cfg = _config(tiny_llama)
    skel = skeleton_from_dir(tiny_llama)
    names = [b.name for b in skel.blocks]
    n = cfg["num_hidden_layers"]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    layers = [b for b in skel.blocks if b.layer_index is not None]
    assert [b.name for b in layers] == [f"model.layers.{i}" for i in range(n)]
    assert [b.layer_index for b in layers] == list(range(n))
    assert all(b.no_split for b in layers) and not any(b.no_split for b in skel.blocks if b.layer_index is None)
    assert skel.no_split_classes == ("LlamaDecoderLayer",)
    # a layer block holds its whole subtree, and nothing from its neighbours
    assert all(t.name.startswith(b.name + ".") for b in layers for t in b.tensors)
    assert len(layers[0].tensors) == 9  # q k v o, gate up down, two norms
    head = skel.blocks[-1]
    assert head.is_head and not head.is_embedding and not any(t.quantizable for t in head.tensors)
    assert skel.blocks[0].is_embedding and not skel.blocks[0].is_head
    assert [b.name for b in skel.blocks if b.is_head] == ["lm_head"]
    q = {t.name: t for t in skel.tensors()}
    assert q["model.layers.0.self_attn.q_proj.weight"].quantizable
    assert not q["model.layers.0.input_layernorm.weight"].quantizable
    assert not q["model.embed_tokens.weight"].quantizable
    # rotary inv_freq: a non-persistent buffer, absent from the checkpoint but sized by the planner
    rot = [t for t in skel.tensors() if t.name.endswith("inv_freq")]
    assert rot and all(t.kind == "buffer_nonpersistent" and t.dtype == "float32" for t in rot)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert skel.kv is not None
    assert (skel.kv.num_layers, skel.kv.num_kv_heads, skel.kv.head_dim) == (n, cfg["num_key_value_heads"], head_dim)
    assert skel.kv.num_kv_heads < cfg["num_attention_heads"]  # the fixture is GQA
    assert skel.vocab_size == cfg["vocab_size"] and skel.hidden_size == cfg["hidden_size"]
    assert skel.intermediate_size == cfg["intermediate_size"]
    assert skel.num_attention_heads == cfg["num_attention_heads"]
    assert skel.tied_groups == ()
    assert skel.architecture == "LlamaForCausalLM" and skel.model_type == "llama"
    assert skel.name == tiny_llama.name


def test_config_json_and_dict_give_the_same_structure_as_the_dir(tiny_llama):
    from_dir = skeleton_from_dir(tiny_llama)
    from_json = load_skeleton(tiny_llama / "config.json")
    from_dict = load_skeleton(_config(tiny_llama))
    for s in (from_json, from_dict):
        assert [b.name for b in s.blocks] == [b.name for b in from_dir.blocks]
        assert {n: v[0] for n, v in _tensor_map(s).items()} == {n: v[0] for n, v in _tensor_map(from_dir).items()}
        assert s.kv == from_dir.kv


def test_model_walk_of_real_and_meta_models_agree(tiny_llama):
    real = skeleton_from_model(_loaded(tiny_llama), name="x")
    meta = skeleton_from_config(tiny_llama / "config.json", name="x")
    assert real.blocks == meta.blocks and real.kv == meta.kv


def test_layer_prefixes_do_not_capture_neighbours():
    """model.layers.1 must not swallow model.layers.10.* (string-prefix trap)."""
    skel = skeleton_from_config(
        dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=12,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
    )
    layers = [b for b in skel.blocks if b.layer_index is not None]
    assert [b.layer_index for b in layers] == list(range(12))
    assert all(len(b.tensors) == 9 for b in layers)


# ------------------------------------------------------------------------------------------------ GPT-2


def test_gpt2_tied_head(tiny_gpt2):
    cfg = _config(tiny_gpt2)
    skel = skeleton_from_dir(tiny_gpt2)
    assert skel.tied_groups == (("transformer.wte.weight", "lm_head.weight"),)
    names = [t.name for t in skel.tensors()]
    assert "lm_head.weight" not in names and names.count("transformer.wte.weight") == 1
    head = [b for b in skel.blocks if b.is_head]
    assert [b.name for b in head] == ["lm_head"] and head[0].tensors == ()  # kept, empty: the tie lives in wte
    emb = {b.name for b in skel.blocks if b.is_embedding}
    assert emb == {"transformer.wte", "transformer.wpe"}
    ck = read_checkpoint_headers(tiny_gpt2)
    assert {n for n, v in _tensor_map(skel).items() if v[2] != "buffer_nonpersistent"} == set(ck.tensors)
    # Conv1D weights are what bitsandbytes would quantize
    q = {t.name: t.quantizable for t in skel.tensors()}
    assert q["transformer.h.0.attn.c_attn.weight"] and q["transformer.h.0.mlp.c_proj.weight"]
    assert not q["transformer.h.0.attn.c_attn.bias"] and not q["transformer.wte.weight"]
    assert skel.kv is not None
    assert (skel.kv.num_layers, skel.kv.num_kv_heads, skel.kv.head_dim) == (
        cfg["n_layer"],
        cfg["n_head"],
        cfg["n_embd"] // cfg["n_head"],
    )
    assert skel.intermediate_size == (cfg.get("n_inner") or 4 * cfg["n_embd"])
    assert skel.no_split_classes == ("GPT2Block",)
    _assert_matches_loaded_model(skel, _loaded(tiny_gpt2))


def test_untied_gpt2_has_no_group():
    skel = skeleton_from_config(
        dict(
            model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, tie_word_embeddings=False
        )
    )
    assert skel.tied_groups == ()
    head = [b for b in skel.blocks if b.is_head][0]
    assert [t.name for t in head.tensors] == ["lm_head.weight"]


# ------------------------------------------------------------------------------------------------ MoE


def test_moe_checkpoint_keys_cover_every_key_once(tiny_moe):
    cfg = _config(tiny_moe)
    skel = skeleton_from_dir(tiny_moe)
    ck = read_checkpoint_headers(tiny_moe)
    assert any(".experts.0." in k for k in ck.tensors), "fixture should store per-expert keys"
    mapped = [k for keys in skel.checkpoint_keys.values() for k in keys]
    assert sorted(mapped) == sorted(ck.tensors)  # every key, exactly once
    block_names = {b.name for b in skel.blocks}
    assert set(skel.checkpoint_keys) <= block_names
    for b in skel.blocks:
        keys = skel.checkpoint_keys.get(b.name, ())
        # each block's stored bytes equal its parameters' bytes (fused experts = the sum of per-expert tensors)
        stored = sum(ck.tensors[k].nbytes for k in keys)
        params = sum(int(t.numel * DTYPE_BYTES[t.dtype]) for t in b.tensors if t.kind == "parameter")
        assert stored == params, b.name
        if b.layer_index is not None:
            assert all(k.startswith(b.name + ".") for k in keys)
            assert len([k for k in keys if ".experts." in k]) == 3 * cfg["num_local_experts"]
    assert skel.checkpoint_keys["model.layers.0"]
    assert skel.intermediate_size == cfg["num_experts_per_tok"] * cfg["intermediate_size"]
    fused = [t for t in skel.tensors() if t.name.endswith("experts.gate_up_proj")]
    assert len(fused) == cfg["num_hidden_layers"] and fused[0].shape[0] == cfg["num_local_experts"]
    assert not fused[0].quantizable
    _assert_matches_loaded_model(skel, _loaded(tiny_moe))


# ------------------------------------------------------------------------------------------------ walking rules


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.norm = nn.LayerNorm(4)


class _Toy(nn.Module):
    _no_split_modules = ["_Layer"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.pos = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([_Layer() for _ in range(3)])
        self.extra = _Layer()  # no-split, but not in a ModuleList: no layer index
        self.final = nn.Linear(4, 4)
        self.register_buffer("root_buf", torch.zeros(3))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # shared Parameter object, no declared ties

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_walking_rules_on_a_custom_module():
    skel = skeleton_from_model(_Toy(), name="toy")
    blocks = {b.name: b for b in skel.blocks}
    assert list(blocks) == ["", "embed", "pos", "layers.0", "layers.1", "layers.2", "extra", "final", "head"]
    assert [t.name for t in blocks[""].tensors] == ["root_buf"] and blocks[""].tensors[0].kind == "buffer"
    layer = blocks["layers.1"]
    assert layer.no_split and layer.layer_index == 1
    # module pre-order; within a module, its parameters then its buffers
    assert [(t.name, t.kind) for t in layer.tensors] == [
        ("layers.1.inner.scale", "buffer"),
        ("layers.1.inner.cache", "buffer_nonpersistent"),
        ("layers.1.inner.proj.weight", "parameter"),
        ("layers.1.inner.proj.bias", "parameter"),
        ("layers.1.norm.weight", "parameter"),
        ("layers.1.norm.bias", "parameter"),
    ]
    assert blocks["extra"].no_split and blocks["extra"].layer_index is None
    assert blocks["embed"].is_embedding and blocks["pos"].is_embedding and not blocks["final"].is_embedding
    assert blocks["head"].is_head and blocks["head"].tensors == ()
    assert skel.tied_groups == (("embed.weight", "head.weight"),)
    assert blocks["final"].tensors[0].quantizable and not blocks["final"].tensors[1].quantizable
    assert skel.kv is None and skel.default_dtype == "float32" and skel.no_split_classes == ("_Layer",)
    assert len(skel.tensors()) == 1 + 1 + 6 * 4 + 2 + 1  # embed, pos, 4 no-split layers, final, root_buf


def test_default_dtype_and_meta_dtypes_follow_config():
    skel = skeleton_from_config(
        dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=64,
            dtype="bfloat16",
        )
    )
    assert skel.default_dtype == "bfloat16"
    assert {t.dtype for t in skel.tensors() if t.kind == "parameter"} == {"bfloat16"}
    assert skel.kv.num_kv_heads == 1


# ------------------------------------------------------------------------------------------------ errors and fallbacks


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        load_skeleton(tmp_path / "nope")


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(ModelSourceError, match="expected config.json and safetensors weights"):
        load_skeleton(tmp_path)


def test_directory_with_only_pickle_weights(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not unpickled")
    with pytest.raises(ModelSourceError, match="refuses to read"):
        load_skeleton(tmp_path)


def test_directory_without_weights(tmp_path, tiny_llama):
    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelSourceError, match=r"no safetensors weights.*pass .*config\.json instead"):
        load_skeleton(tmp_path)


def test_unknown_architecture_suggests_near_names(tmp_path):
    with pytest.raises(ModelSourceError, match=r"'lamma' is not known.*llama"):
        load_skeleton({"model_type": "lamma", "hidden_size": 8})
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"architectures": ["FooBarForCausalLM"]}))
    with pytest.raises(ModelSourceError, match="FooBarForCausalLM"):
        load_skeleton(p)
    with pytest.raises(ModelSourceError, match="neither 'model_type' nor 'architectures'"):
        load_skeleton({"hidden_size": 8})


def test_architectures_alone_is_enough():
    skel = load_skeleton(
        {
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
        }
    )
    assert skel.model_type == "mistral" and skel.architecture == "MistralForCausalLM"


def test_bad_config_files(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ModelSourceError, match="cannot read it as JSON"):
        load_skeleton(p)
    p.write_text("[]")
    with pytest.raises(ModelSourceError, match="expected a JSON object"):
        load_skeleton(p)
    t = tmp_path / "weights.txt"
    t.write_text("x")
    with pytest.raises(ModelSourceError, match="expected a model directory or a .json config"):
        load_skeleton(t)


def test_load_skeleton_returns_skeletons_unchanged(tiny_llama):
    skel = skeleton_from_dir(tiny_llama)
    assert load_skeleton(skel) is skel
    assert load_skeleton(str(tiny_llama)).blocks == skel.blocks


def _copy_weights(src: Path, dst: Path) -> None:
    for p in src.iterdir():
        if p.suffix in (".safetensors", ".json") and p.name != "config.json":
            shutil.copy(p, dst / p.name)


def test_dir_without_config_is_inferred_from_headers(tmp_path, tiny_llama, caplog):
    _copy_weights(tiny_llama, tmp_path)
    with caplog.at_level(logging.WARNING, logger=SKELETON_LOG):
        skel = load_skeleton(tmp_path)
    assert "inferred" in caplog.text
    ref = skeleton_from_dir(tiny_llama)
    ck = read_checkpoint_headers(tiny_llama)
    assert {t.name for t in skel.tensors()} == set(ck.tensors)
    ref_layers = [(b.name, b.layer_index) for b in ref.blocks if b.layer_index is not None]
    assert [(b.name, b.layer_index) for b in skel.blocks if b.no_split] == ref_layers
    names = [b.name for b in skel.blocks]
    assert names[0] == "model.embed_tokens" and skel.blocks[0].is_embedding
    assert names[-1] == "lm_head" and skel.blocks[-1].is_head
    assert names.index("model.norm") > names.index(ref_layers[-1][0])
    assert skel.kv is None


def test_unknown_architecture_in_a_dir_falls_back_to_headers(tmp_path, tiny_llama, caplog):
    _copy_weights(tiny_llama, tmp_path)
    cfg = _config(tiny_llama)
    cfg["model_type"] = "no_such_arch"
    cfg["architectures"] = ["NoSuchForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger=SKELETON_LOG):
        skel = load_skeleton(tmp_path)
    assert "inferred" in caplog.text and "no_such_arch" in caplog.text
    assert skel.kv is not None and skel.kv.num_layers == cfg["num_hidden_layers"]
    assert skel.kv.num_kv_heads == cfg["num_key_value_heads"]
    assert len([b for b in skel.blocks if b.no_split]) == cfg["num_hidden_layers"]


def test_config_and_weights_that_disagree_are_reported(tmp_path, tiny_llama, caplog):
    _copy_weights(tiny_llama, tmp_path)
    cfg = _config(tiny_llama)
    cfg["intermediate_size"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger=SKELETON_LOG):
        skel = load_skeleton(tmp_path)
    assert "differ in shape" in caplog.text and "may not belong together" in caplog.text
    assert skel.intermediate_size == cfg["intermediate_size"]


def test_stored_dtype_comes_from_headers(tmp_path):
    """A config without dtype over a bf16 checkpoint: parameters take the stored dtype."""
    cfg = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    meta = skeleton_from_config(cfg)
    write_sparse_checkpoint(
        tmp_path, {t.name: ("bfloat16", t.shape) for t in meta.tensors() if t.kind == "parameter"}, shards=2
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    skel = skeleton_from_dir(tmp_path)
    assert {t.dtype for t in skel.tensors() if t.kind == "parameter"} == {"bfloat16"}
    assert {t.dtype for t in skel.tensors() if t.kind != "parameter"} == {"float32"}
    assert skel.default_dtype == "bfloat16" and skel.checkpoint_keys == {}


class _Declared(nn.Module):
    """Ties declared the transformers way, between distinct objects, plus a module registered under two names."""

    all_tied_weights_keys = {"out.weight": "inp.weight"}

    def __init__(self):
        super().__init__()
        self.inp = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.again = self.mid  # the same module under a second name
        self.out = nn.Linear(4, 6, bias=False)  # its own Parameter object, but declared tied to inp.weight

    def get_output_embeddings(self):
        return self.out


def test_declared_ties_and_shared_modules():
    skel = skeleton_from_model(_Declared(), name="declared")
    assert [t.name for t in skel.tensors()] == ["inp.weight", "mid.weight", "mid.bias"]
    assert set(skel.tied_groups) == {
        ("inp.weight", "out.weight"),
        ("mid.weight", "again.weight"),
        ("mid.bias", "again.bias"),
    }
    assert [b.name for b in skel.blocks] == ["inp", "mid", "out"] and skel.blocks[-1].is_head


def test_declared_tie_to_a_missing_source_keeps_the_tensor():
    class Broken(_Declared):
        all_tied_weights_keys = {"out.weight": "nowhere.weight"}

    skel = skeleton_from_model(Broken(), name="broken")
    assert "out.weight" in {t.name for t in skel.tensors()}
    assert all("out.weight" not in g for g in skel.tied_groups)


def test_corrupt_shard_in_a_model_dir_is_a_header_error(tmp_path, tiny_llama):
    from planner.errors import HeaderError

    _copy_weights(tiny_llama, tmp_path)
    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    os_size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(os_size - 3)
    with pytest.raises(HeaderError, match=shard.name):
        load_skeleton(tmp_path)


def test_misspelt_class_name_gets_suggestions():
    with pytest.raises(ModelSourceError, match=r"Nearest known names:.*LlamaForCausalLM"):
        load_skeleton({"architectures": ["LLamaForCausalLM"]})


def test_legacy_gpt2_layout_without_prefix(tmp_path, caplog):
    """Hub GPT-2 checkpoints store ``h.0...`` without ``transformer.``, plus legacy attention-mask buffers."""
    cfg = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)
    meta = skeleton_from_config(cfg)
    stored = {t.name.removeprefix("transformer."): ("float16", t.shape) for t in meta.tensors()}
    stored.update({f"h.{i}.attn.bias": ("float32", (1, 1, 16, 16)) for i in range(2)})
    write_sparse_checkpoint(tmp_path, stored, shards=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger=SKELETON_LOG):
        skel = skeleton_from_dir(tmp_path)
    assert not [r for r in caplog.records if r.name == SKELETON_LOG]  # extra legacy buffers are not a mismatch
    assert sorted(k for ks in skel.checkpoint_keys.values() for k in ks) == sorted(stored)
    assert "h.1.attn.bias" in skel.checkpoint_keys["transformer.h.1"]
    assert skel.checkpoint_keys["transformer.wte"] == ("wte.weight",)
    assert {t.dtype for t in skel.tensors()} == {"float16"}  # stored dtype applied through the prefix
    assert [b.name for b in skel.blocks] == [b.name for b in meta.blocks]


def test_invalid_config_values_are_model_source_errors():
    with pytest.raises(ModelSourceError, match=r"not a valid llama config.*not a multiple"):
        load_skeleton(dict(model_type="llama", hidden_size=10, num_attention_heads=3))
    with pytest.raises(ModelSourceError, match="no causal-LM class for model_type 't5'"):
        load_skeleton(dict(model_type="t5"))
