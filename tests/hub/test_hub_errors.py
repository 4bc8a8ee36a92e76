"""Every way a Hub id can fail gives one line saying what to do, and exit code 2, before any weight moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hub.conftest import TINY, dead_endpoint, hub_env, loadmaster
from tests.hub.fake_hub import FakeHub


def _one_line_error(r, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("loadmaster: error:")]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_gated_without_a_token(fake_hub: FakeHub, tmp_path: Path, command: str) -> None:
    r = loadmaster([command, "org/gated", "--max-memory", "cpu=1GiB"], hub_env(fake_hub.url, tmp_path))
    _one_line_error(r, "org/gated is gated", "HF_TOKEN")


def test_gated_with_a_token_that_has_no_access(fake_hub: FakeHub, tmp_path: Path) -> None:
    r = loadmaster(["serve", "org/gated"], hub_env(fake_hub.url, tmp_path, HF_TOKEN="hf_someone_else"))
    _one_line_error(r, "org/gated is gated", "no access", "403")


def test_gated_with_a_granted_token_plans(fake_hub: FakeHub, tmp_path: Path) -> None:
    r = loadmaster(
        ["plan", "org/gated", "--max-memory", "cpu=1GiB"], hub_env(fake_hub.url, tmp_path, HF_TOKEN="hf_granted")
    )
    assert r.returncode == 0, r.stderr
    assert "Plan for org/gated at commit" in r.stdout


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_missing_repository(fake_hub: FakeHub, tmp_path: Path, command: str) -> None:
    r = loadmaster([command, "org/no-such-model"], hub_env(fake_hub.url, tmp_path))
    _one_line_error(r, "org/no-such-model", "no such repository", "404")


def test_missing_revision(fake_hub: FakeHub, tmp_path: Path) -> None:
    r = loadmaster(["serve", f"{TINY}@no-such-branch"], hub_env(fake_hub.url, tmp_path))
    _one_line_error(r, TINY, "no revision 'no-such-branch'", "404")


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_pickled_only_repository_is_refused_naming_the_files(fake_hub: FakeHub, tmp_path: Path, command: str) -> None:
    mark = fake_hub.mark()
    r = loadmaster([command, "org/pickled-only"], hub_env(fake_hub.url, tmp_path))
    _one_line_error(r, "only pickled weights", "pytorch_model.bin", "training_args.bin", "safetensors")
    assert not [q for q in fake_hub.since(mark) if q.path.endswith(".bin") and q.method == "GET"]


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_no_network_and_no_cache(tmp_path: Path, command: str) -> None:
    r = loadmaster([command, TINY], hub_env(dead_endpoint(), tmp_path / "empty-cache"))
    _one_line_error(r, TINY, "cannot be reached", "not in the Hub cache")


def test_offline_without_cache(tmp_path: Path) -> None:
    r = loadmaster(["plan", TINY], hub_env(dead_endpoint(), tmp_path / "empty-cache", HF_HUB_OFFLINE="1"))
    _one_line_error(r, TINY, "HF_HUB_OFFLINE is set", "not in the Hub cache")


def test_not_enough_disk_is_refused_before_downloading(fake_hub: FakeHub, tmp_path: Path) -> None:
    mark = fake_hub.mark()
    r = loadmaster(["serve", "org/huge"], hub_env(fake_hub.url, tmp_path))
    _one_line_error(r, "not enough disk for org/huge", "free", "HF_HOME")
    assert not [q for q in fake_hub.since(mark) if q.path.endswith(".safetensors") and q.method == "GET"]
