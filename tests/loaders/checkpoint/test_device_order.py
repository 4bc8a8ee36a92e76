"""Device-map resolution: spellings users write, longest-prefix placement, and the errors for bad maps."""

from __future__ import annotations

import pytest
import torch

from loaders.checkpoint.device_order import entry_of, execution_device
from planner.errors import PlanError
from planner.hardware.devices import parse_device
from planner.placement.hf_device_map import assign_devices

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.10.mlp.up_proj.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        ("1", 1),
        ("cuda:2", 2),
        ("cuda", 0),
        (torch.device("cuda", 3), 3),
        (torch.device("cpu"), "cpu"),
        ("CPU", "cpu"),
        ("disk", "disk"),
        ("gpu0", 0),
    ],
)
def test_normalize_device(value, expected):
    assert parse_device(value) == expected


@pytest.mark.parametrize("value", [-1, True, "tpu0", "cuda:x", 1.5, "meta"])
def test_normalize_device_rejects(value):
    with pytest.raises(PlanError):
        parse_device(value)


def test_longest_prefix_wins_and_prefixes_respect_dots():
    dm = {"": "cpu", "model.layers.1": "disk", "model.layers.10.mlp": 0}
    got = assign_devices(NAMES, dm)
    assert got["model.layers.1.mlp.up_proj.weight"] == "disk"
    assert got["model.layers.10.mlp.up_proj.weight"] == 0  # "model.layers.1" must not capture layer 10
    assert got["lm_head.weight"] == "cpu"
    assert entry_of("model.layers.10.mlp.up_proj.weight", dm) == "model.layers.10.mlp"
    assert execution_device(dm) == torch.device("cuda", 0)
    assert execution_device({"": "cpu", "x": "disk"}) == torch.device("cpu")


def test_single_tensor_keys_are_allowed():
    got = assign_devices(NAMES, {"lm_head.weight": "disk", "model": "cpu"})
    assert got["lm_head.weight"] == "disk"


@pytest.mark.parametrize("fixture,tied", [("tiny_llama", False), ("tiny_gpt2", True)])
def test_an_embedding_looked_up_on_the_host_is_not_pinned(fixture, tied, request):
    """Issue 34 defect 5: an input embedding on ``cpu`` beside GPUs is looked up on the host (only its rows' hidden
    states cross), so it is left unpinned; a table tied to the output head crosses as the head and stays pinned."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from loaders.checkpoint.device_order import host_computed

    config = AutoConfig.from_pretrained(request.getfixturevalue(fixture))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)) + ".weight"
    layer = next(n for n, _ in model.named_parameters() if ".0." in n)
    device_map = {"": 0, embedding.removesuffix(".weight"): "cpu", layer.rsplit(".", 1)[0]: "cpu"}
    unpinned = host_computed(model, device_map, (), [embedding, layer])
    assert unpinned == (set() if tied else {embedding})  # the streamed layer is pinned either way
