"""The suite runs on its own caches (tests/user_caches.py): in this process, in its subprocesses, and the check
that fails the run when the user's own cache changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from planner.user_cache import user_cache_path
from tests import user_caches
from tests.conftest import REAL_CACHE

ROOT = Path(__file__).resolve().parent.parent


def test_every_cache_points_at_the_run_folder(run_caches: Path) -> None:
    from loaders.native import kernel_build
    from planner.hardware.calibration import calibration_path
    from service.model.demo_model import default_demo_dir
    from tests import models

    assert user_cache_path("x").is_relative_to(run_caches)
    assert default_demo_dir().is_relative_to(run_caches)
    assert Path(os.environ["HF_HOME"]).is_relative_to(run_caches)
    assert calibration_path() is None
    assert kernel_build.cache_dir() == models.cache_dir() / "kernels"
    assert not run_caches.is_relative_to(REAL_CACHE) and not REAL_CACHE.is_relative_to(run_caches)
    for var in user_caches.REMOVED:
        assert var not in os.environ


def test_a_filtered_subprocess_environment_keeps_the_run_caches(run_caches: Path) -> None:
    """What tests/hub/conftest.py and the README test do: drop LOADMASTER_*, add the run's caches back."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADMASTER_")}
    env.update(user_caches.env(), PYTHONPATH=str(ROOT))
    code = (
        "from planner.user_cache import user_cache_path; from planner.hardware.calibration import calibration_path;"
        "from service.model.demo_model import default_demo_dir;"
        "print(user_cache_path('x')); print(calibration_path()); print(default_demo_dir())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    cache, calibration, demo = out.splitlines()
    assert Path(cache).is_relative_to(run_caches) and Path(demo).is_relative_to(run_caches)
    assert calibration == "None"


def test_changes_name_what_was_added_removed_and_rewritten(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "a.so").write_bytes(b"1")
    (tmp_path / "calibration.json").write_text("{}")
    before = user_caches.listing(tmp_path)
    assert user_caches.changes(before, user_caches.listing(tmp_path)) == []
    (tmp_path / "calibration.json").unlink()
    (tmp_path / "kernels" / "a.so").write_bytes(b"22")
    (tmp_path / "demo-model").mkdir()
    changed = user_caches.changes(before, user_caches.listing(tmp_path))
    assert "+ demo-model" in changed and "- calibration.json" in changed and "~ kernels/a.so" in changed
    assert user_caches.listing(tmp_path / "absent") == {}
