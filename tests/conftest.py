"""Session-wide fixtures: the shared tiny models, built once per cache and never downloaded."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests import models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return models.tiny_llama_dir()


@pytest.fixture(scope="session")
def tiny_gpt2() -> Path:
    return models.tiny_gpt2_dir()


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    return models.tiny_moe_dir()
