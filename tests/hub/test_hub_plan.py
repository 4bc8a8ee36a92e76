"""``loadmaster plan org/name``: config.json and shard headers only, the same plan as from the local folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
import planner.placement.estimate
from planner.errors import ModelSourceError
from planner.model.model_ref import HubRef, parse_model_ref
from planner.types import PREFILL_CHUNK, Plan
from tests.hub.conftest import BIG, TINY, hub_env, loadmaster
from tests.hub.fake_hub import FakeHub

PLAN_FLAGS = ["--gpus", "2x650MiB", "--max-memory", "cpu=8GiB", "--dtype", "bf16", "--context", "512"]


def _comparable(plan: Plan) -> dict:
    d = plan.to_dict()
    d.pop("model")
    d.pop("revision")
    return d


def test_plan_by_id_reads_headers_only_and_equals_the_local_plan(
    fake_hub: FakeHub, big_llama: Path, tmp_path: Path
) -> None:
    weights = sum(p.stat().st_size for p in big_llama.glob("*.safetensors"))
    assert weights >= 100 * 10**6
    mark = fake_hub.mark()
    r = loadmaster(["plan", BIG, "--json", *PLAN_FLAGS], hub_env(fake_hub.url, tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    served = sum(q.sent for q in fake_hub.since(mark))
    assert served < 10**6, [(q.path, q.range, q.sent) for q in fake_hub.since(mark)]
    # weights were only ever asked for by their first bytes (the header)
    for q in fake_hub.since(mark):
        if q.path.endswith(".safetensors") and q.method == "GET":
            assert q.range == "bytes=0-100000"

    remote = Plan.from_json(r.stdout)
    repo = fake_hub.repos[BIG]
    assert remote.model == BIG and remote.revision == repo.commit
    local = planner.plan(
        str(big_llama),
        gpus="2x650MiB",
        max_memory={"cpu": "8GiB"},
        dtype="bf16",
        context=512,
        prefill_chunk=PREFILL_CHUNK,
    )
    assert local.revision is None
    assert len({dev for dev in local.device_map.values()}) > 1  # the plan splits the model: a real comparison
    assert _comparable(remote) == _comparable(local)


def test_plan_names_a_revision_and_the_estimate_takes_ids(fake_hub: FakeHub, tiny_llama: Path, tmp_path: Path) -> None:
    repo = fake_hub.repos[TINY]
    env = hub_env(fake_hub.url, tmp_path / "hf")
    r = loadmaster(["plan", f"{TINY}@{repo.commit}", "--max-memory", "cpu=1GiB"], env)
    assert r.returncode == 0, r.stderr
    assert f"Plan for {TINY} at commit {repo.commit}" in r.stdout
    r = loadmaster(["estimate", TINY, "--json"], env)
    assert r.returncode == 0, r.stderr
    remote = json.loads(r.stdout)
    local = planner.placement.estimate.estimate(str(tiny_llama))
    assert [{k: v for k, v in row.items() if k != "model"} for row in remote] == [
        {k: v for k, v in row.items() if k != "model"} for row in local
    ]
    assert remote[0]["model"] == TINY


def test_plan_offline_uses_a_cached_snapshot(fake_hub: FakeHub, tiny_llama: Path, tmp_path: Path) -> None:
    """A model already served once (in the cache) plans with HF_HUB_OFFLINE=1 and no Hub at all."""
    import shutil

    from huggingface_hub.file_download import repo_folder_name

    repo = fake_hub.repos[TINY]
    storage = tmp_path / "hf" / "hub" / repo_folder_name(repo_id=TINY, repo_type="model")
    snap = storage / "snapshots" / repo.commit
    snap.mkdir(parents=True)
    for f in tiny_llama.iterdir():
        shutil.copy(f, snap / f.name)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(repo.commit)
    mark = fake_hub.mark()
    r = loadmaster(
        ["plan", TINY, "--json", "--max-memory", "cpu=1GiB"], hub_env(fake_hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1")
    )
    assert r.returncode == 0, r.stderr
    assert not fake_hub.since(mark)
    p = Plan.from_json(r.stdout)
    assert p.revision == repo.commit and p.model == TINY
    assert _comparable(p) == _comparable(
        planner.plan(str(tiny_llama), max_memory={"cpu": "1GiB"}, prefill_chunk=PREFILL_CHUNK)
    )


def test_model_references(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_model_ref("org/name") == HubRef("org/name", None)
    assert parse_model_ref("org/name@v1.0") == HubRef("org/name", "v1.0")
    assert parse_model_ref("org/name@refs/pr/3") == HubRef("org/name", "refs/pr/3")
    assert parse_model_ref("hf://org/name") == HubRef("org/name", None)
    assert parse_model_ref("nothing-here") is None
    assert parse_model_ref("a/b/c") is None
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_model_ref("org/name") == Path("org/name")  # a local path keeps priority
    assert parse_model_ref("hf://org/name") == HubRef("org/name", None)
    with pytest.raises(ModelSourceError, match="not a Hub reference"):
        parse_model_ref("hf://not a repo")


def test_a_name_that_is_both_a_path_and_a_cached_repo_is_reported_ambiguous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "cache" / repo_folder_name(repo_id="org/name", repo_type="model")).mkdir(parents=True)
    with caplog.at_level("WARNING", logger="planner.model.model_ref"):
        assert parse_model_ref("org/name") == Path("org/name")
    assert "ambiguous" in caplog.text and "hf://org/name" in caplog.text
