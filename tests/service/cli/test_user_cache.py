"""One root for what loadmaster keeps between runs (:mod:`planner.user_cache`)."""

from __future__ import annotations

from pathlib import Path

from planner.user_cache import user_cache_path


def test_the_root_follows_xdg_and_each_variable_moves_its_own() -> None:
    home = Path.home()
    assert user_cache_path("kernels", "LM_X", {}) == home / ".cache" / "loadmaster" / "kernels"
    assert user_cache_path("kernels", "LM_X", {"XDG_CACHE_HOME": ""}) == home / ".cache" / "loadmaster" / "kernels"
    assert user_cache_path("kernels", "LM_X", {"XDG_CACHE_HOME": "/c"}) == Path("/c/loadmaster/kernels")
    assert user_cache_path("kernels", "LM_X", {"XDG_CACHE_HOME": "/c", "LM_X": "~/k"}) == home / "k"
    assert user_cache_path("kernels", "LM_X", {"XDG_CACHE_HOME": "/c", "LM_X": ""}) == Path("/c/loadmaster/kernels")
    assert user_cache_path("calibration.json", environ={"XDG_CACHE_HOME": "/c"}) == Path(
        "/c/loadmaster/calibration.json"
    )


def test_every_cache_of_the_project_sits_under_the_one_root(monkeypatch, tmp_path: Path) -> None:
    from loaders.native import kernel_build, linear
    from planner.hardware.calibration import calibration_path
    from planner.user_cache import default_offload_folder
    from service.cli import import_table
    from service.model.demo_model import default_demo_dir

    for var in (
        "LOADMASTER_KERNEL_CACHE",
        "LOADMASTER_OFFLOAD_DIR",
        "LOADMASTER_CALIBRATION",
        "LOADMASTER_IMPORT_CACHE_DIR",
        "LOADMASTER_HOME",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "loadmaster"
    assert kernel_build.cache_dir() == root / "kernels"
    assert linear.probe_cache_dir() == root / "kernels" / "probes"
    assert default_offload_folder(tmp_path).parent == root / "offload"
    assert calibration_path() == root / "calibration.json"
    assert import_table.cache_dir() == root / "import-structure"
    assert default_demo_dir() == root / "demo-model"
