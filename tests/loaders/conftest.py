"""Loader-test fixtures: keep every default offload folder inside pytest's temporary directory."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _offload_dir_in_tmp(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("LOADMASTER_OFFLOAD_DIR", str(tmp_path_factory.mktemp("default-offload")))
    yield
    mp.undo()
