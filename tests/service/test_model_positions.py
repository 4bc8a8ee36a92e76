"""The position limit both /plan and the served load cap the context at, from each family's config spelling."""

from __future__ import annotations

import json
from pathlib import Path

from service.model_positions import model_position_limit

ROOT = Path(__file__).resolve().parents[2]


def test_every_families_spelling_is_read(tmp_path: Path):
    assert model_position_limit(ROOT / "examples" / "configs" / "llama-3-8b.json") == 8192
    assert model_position_limit(ROOT / "examples" / "configs" / "gpt2-xl.json") == 1024  # n_positions
    assert model_position_limit({"text_config": {"max_position_embeddings": 4096}, "vision_config": {}}) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"max_sequence_length": 2048}))
    assert model_position_limit(tmp_path) == 2048


def test_an_unstated_or_unreadable_limit_is_none(tmp_path: Path):
    assert model_position_limit({"hidden_size": 8}) is None
    assert model_position_limit({"max_position_embeddings": 0}) is None
    assert model_position_limit(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text("[1, 2]")
    assert model_position_limit(tmp_path) is None
