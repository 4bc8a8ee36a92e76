"""Hub ids inside one process: ``/plan`` (only with ``--allow-hub-plan``) and ``loaders.load_model``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import planner
from loaders import load_model
from loaders.errors import CheckpointError
from planner.types import PREFILL_CHUNK, Plan
from tests.hub.conftest import BIG, TINY
from tests.hub.fake_hub import FakeHub
from tests.service.conftest import LiveServer, settings_for


@pytest.fixture()
def hub_here(fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """Point this process's huggingface_hub at the fake Hub (the session runs with HF_HUB_OFFLINE=1 otherwise)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake_hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return fake_hub


@pytest.fixture(scope="module")
def servers(tiny_llama: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    """The tiny model served twice: with and without --allow-hub-plan."""
    allowed = LiveServer(settings_for(tiny_llama, allow_hub_plan=True)).start()
    closed = LiveServer(settings_for(tiny_llama)).start()
    yield allowed, closed
    allowed.stop()
    closed.stop()


def test_plan_route_takes_hub_ids_only_when_allowed(hub_here: FakeHub, servers, big_llama: Path) -> None:
    allowed, closed = servers
    body = {"model": BIG, "gpus": "2x650MiB", "max_memory": {"cpu": "8GiB"}, "dtype": "bf16", "context": 512}
    mark = hub_here.mark()
    r = httpx.post(closed.url + "/plan", json=body, timeout=60)
    assert r.status_code == 403, r.text
    assert "--allow-hub-plan" in r.json()["error"]
    assert not hub_here.since(mark)  # refused before any outbound request

    r = httpx.post(allowed.url + "/plan", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert sum(q.sent for q in hub_here.since(mark)) < 10**6
    remote = Plan.from_dict(r.json())
    assert remote.revision == hub_here.repos[BIG].commit
    local = planner.plan(
        str(big_llama),
        gpus="2x650MiB",
        max_memory={"cpu": "8GiB"},
        dtype="bf16",
        context=512,
        prefill_chunk=PREFILL_CHUNK,
    )
    assert {**remote.to_dict(), "model": None, "revision": None} == {**local.to_dict(), "model": None}

    r = httpx.post(allowed.url + "/plan", json={**body, "model": "org/no-such-model"}, timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "hub"
    assert "no such repository" in r.json()["error"]


def test_load_model_by_id_matches_transformers(hub_here: FakeHub, tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_model(TINY, device_map="auto", max_memory={"cpu": "2GiB"}, dtype="float32", show_progress=False)
    assert model.loadmaster_plan.revision == hub_here.repos[TINY].commit
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def test_a_plan_for_another_commit_is_refused(hub_here: FakeHub) -> None:
    the_plan = planner.plan(TINY, max_memory={"cpu": "1GiB"}, prefill_chunk=PREFILL_CHUNK)
    assert the_plan.revision == hub_here.repos[TINY].commit
    stale = Plan.from_dict({**the_plan.to_dict(), "revision": "0" * 40})
    with pytest.raises(CheckpointError, match="plan again for this revision"):
        load_model(TINY, device_map=stale, show_progress=False)
    model = load_model(TINY, device_map=the_plan, show_progress=False)
    assert model.hf_device_map == the_plan.device_map
