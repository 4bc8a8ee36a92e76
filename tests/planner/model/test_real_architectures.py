"""Skeletons of real architectures at their real sizes (meta device only), checked against transformers and
against the models' published figures."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from planner.model.safetensors_header import read_checkpoint_headers
from planner.model.skeleton import config_from_dict, skeleton_from_config, skeleton_from_dir
from planner.types import DTYPE_BYTES

try:
    from tests.planner.real_configs import PUBLIC, REAL_CONFIGS, checkpoint_tensors, write_real_checkpoint
except ImportError:  # run without the repository root on sys.path
    from real_configs import PUBLIC, REAL_CONFIGS, checkpoint_tensors, write_real_checkpoint


def _meta_model(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_from_dict(REAL_CONFIGS[name]))


def _bytes_by_dtype(pairs) -> Counter:
    c: Counter = Counter()
    for dtype, nbytes in pairs:
        c[dtype] += nbytes
    return c


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_architecture_skeleton(name):
    facts = PUBLIC[name]
    skel = skeleton_from_config(REAL_CONFIGS[name], name=name)
    model = _meta_model(name)

    # every tensor of the model exactly once (tied tensors under their first name), nothing extra
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    names = [t.name for t in skel.tensors()]
    assert len(names) == len(set(names))
    assert set(names) == {n for n, _ in tensors}

    # bytes per dtype equal the meta model's parameters and buffers, tied once
    want = _bytes_by_dtype((str(t.dtype).replace("torch.", ""), t.numel() * t.element_size()) for _, t in tensors)
    got = _bytes_by_dtype((t.dtype, int(t.numel * DTYPE_BYTES[t.dtype])) for t in skel.tensors())
    assert got == want

    # the published parameter count, within 1%
    params = sum(t.numel for t in skel.tensors() if t.kind == "parameter")
    assert params == pytest.approx(facts.params, rel=0.01)

    # KV geometry and layers
    assert skel.kv is not None
    assert (skel.kv.num_layers, skel.kv.num_kv_heads, skel.kv.head_dim) == (
        facts.num_layers,
        facts.num_kv_heads,
        facts.head_dim,
    )
    layers = [b for b in skel.blocks if b.layer_index is not None]
    assert [b.layer_index for b in layers] == list(range(facts.num_layers))
    assert all(b.no_split for b in layers)
    assert skel.vocab_size == REAL_CONFIGS[name]["vocab_size"]
    assert skel.default_dtype == REAL_CONFIGS[name]["dtype"]

    # tying, head and embeddings
    heads = [b for b in skel.blocks if b.is_head]
    assert len(heads) == 1 and heads[0] is skel.blocks[-1]
    assert bool(skel.tied_groups) == facts.tied
    if facts.tied:
        (group,) = skel.tied_groups
        assert group[1] == "lm_head.weight" and heads[0].tensors == ()
        emb = [b for b in skel.blocks if b.is_embedding and any(t.name == group[0] for t in b.tensors)]
        assert len(emb) == 1
    else:
        assert [t.name for t in heads[0].tensors] == ["lm_head.weight"]
    assert skel.blocks[0].is_embedding


def test_mixtral_full_size_checkpoint_maps_every_key(tmp_path):
    """A real (sparse) 8x7B checkpoint in the published per-expert layout: every key lands in one block, and
    each block's stored bytes equal its fused parameters' bytes."""
    name = "mixtral-8x7b"
    meta = skeleton_from_config(REAL_CONFIGS[name], name=name)
    write_real_checkpoint(name, meta, tmp_path, shards=19)
    ck = read_checkpoint_headers(tmp_path)
    assert len(ck.files) == 19 and ck.nbytes == sum(
        int(t.numel * DTYPE_BYTES[t.dtype]) for t in meta.tensors() if t.kind == "parameter"
    )
    skel = skeleton_from_dir(tmp_path)
    mapped = [k for ks in skel.checkpoint_keys.values() for k in ks]
    assert sorted(mapped) == sorted(ck.tensors)
    for b in skel.blocks:
        stored = sum(ck.tensors[k].nbytes for k in skel.checkpoint_keys.get(b.name, ()))
        assert stored == sum(int(t.numel * DTYPE_BYTES[t.dtype]) for t in b.tensors if t.kind == "parameter")
    # 8 experts x (w1 w2 w3), the router, q k v o, two norms
    assert len(skel.checkpoint_keys["model.layers.31"]) == 8 * 3 + 1 + 4 + 2
    assert [b.name for b in skel.blocks] == [b.name for b in meta.blocks]


@pytest.mark.parametrize("name, shards", [("llama-3-70b", 30), ("gpt2-xl", 2)])
def test_full_size_checkpoint_dir_matches_config_skeleton(tmp_path, name, shards):
    meta = skeleton_from_config(REAL_CONFIGS[name], name=name)
    write_real_checkpoint(name, meta, tmp_path, shards=shards)
    assert set(read_checkpoint_headers(tmp_path).tensors) == set(checkpoint_tensors(name, meta))
    skel = skeleton_from_dir(tmp_path, name=name)
    assert skel.blocks == meta.blocks and skel.tied_groups == meta.tied_groups and skel.kv == meta.kv
    assert skel.checkpoint_keys == {}
