"""The position limit both /plan and the served load cap the context at, from each family's config spelling."""

from __future__ import annotations

import json
from pathlib import Path

from service.model.positions import model_position_limit

ROOT = Path(__file__).resolve().parents[3]


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


def test_an_explicit_max_total_tokens_beyond_the_positions_is_refused_and_the_default_is_capped(
    tmp_path: Path, monkeypatch
):
    """Asked for sequences the model cannot hold (flag or environment), the server refuses at start naming the flag,
    rather than quietly serving shorter ones; the default 2048 on a 1024-position model is still capped at load."""
    import pytest

    from service.model.background_load import resolve_model_dir
    from service.settings import ServiceSettings

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 1024}))
    with pytest.raises(ValueError, match=r"--max-total-tokens 4096 is more than the 1024 positions"):
        resolve_model_dir(ServiceSettings(model=str(tmp_path), max_total_tokens=4096))
    monkeypatch.setenv("LOADMASTER_MAX_TOTAL_TOKENS", "2048")
    with pytest.raises(ValueError, match="--max-total-tokens 2048"):
        resolve_model_dir(ServiceSettings(model=str(tmp_path)))
    monkeypatch.delenv("LOADMASTER_MAX_TOTAL_TOKENS")
    assert resolve_model_dir(ServiceSettings(model=str(tmp_path))) == tmp_path.resolve()
    assert resolve_model_dir(ServiceSettings(model=str(tmp_path), max_total_tokens=1024)) == tmp_path.resolve()
