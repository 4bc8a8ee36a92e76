"""POST /plan: dry runs for the served model, model roots and inline configs; what-ifs; path escapes refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import planner
from planner.types import PREFILL_CHUNK, Plan
from service.model.positions import model_position_limit
from tests.service.conftest import LiveServer


def test_plan_of_the_served_model_equals_the_planner(client: httpx.Client, tiny_llama: Path) -> None:
    body = {"max_memory": {"cpu": "64MiB"}, "batch_size": 2, "context": 128}
    r = client.post("/plan", json=body)
    assert r.status_code == 200, r.text
    got = Plan.from_dict(r.json())
    want = planner.plan(
        str(tiny_llama), max_memory={"cpu": "64MiB"}, batch_size=2, context=128, prefill_chunk=PREFILL_CHUNK
    )
    assert got.to_dict() == want.to_dict()
    named = client.post("/plan", json=dict(body, model="tiny-llama")).json()
    assert named == r.json()


def test_plan_for_declared_gpus_from_a_model_root(client: httpx.Client, model_root: Path) -> None:
    r = client.post(
        "/plan",
        json={
            "model": "gpt2-copy",
            "gpus": "2x8MiB",
            "max_memory": {"cpu": "1GiB"},
            "dtype": "float16",
            "strategy": "sequential",
            "context": 64,
        },
    )
    assert r.status_code == 200, r.text
    plan = Plan.from_dict(r.json())
    assert plan.architecture == "GPT2LMHeadModel" and plan.workload.dtype == "float16"
    assert {b.device for b in plan.budgets} >= {0, 1}
    assert plan == planner.plan(
        str(model_root / "gpt2-copy"),
        gpus="2x8MiB",
        max_memory={"cpu": "1GiB"},
        dtype="float16",
        strategy="sequential",
        context=64,
        prefill_chunk=PREFILL_CHUNK,
    )


def test_plan_from_an_inline_config(client: httpx.Client, tiny_moe: Path) -> None:
    config = json.loads((tiny_moe / "config.json").read_text())
    r = client.post("/plan", json={"config": config, "max_memory": {"cpu": "1GiB"}})
    assert r.status_code == 200, r.text
    assert r.json()["architecture"] == "MixtralForCausalLM"


def test_what_if_largest_context_and_batch_are_tight(client: httpx.Client, tiny_llama: Path) -> None:
    mem = {"cpu": "24MiB"}
    r = client.post("/plan", json={"max_memory": mem, "what_if": "max_context", "batch_size": 4})
    assert r.status_code == 200, r.text
    best = r.json()["what_if"]["max_context"]
    assert isinstance(best, int) and best >= 1
    limit = r.json()["what_if"]["limit"]
    assert planner.api.fits(str(tiny_llama), max_memory=mem, batch_size=4, context=best, prefill_chunk=PREFILL_CHUNK)
    if best < limit:
        assert not planner.api.fits(
            str(tiny_llama), max_memory=mem, batch_size=4, context=best + 1, prefill_chunk=PREFILL_CHUNK
        )

    r = client.post("/plan", json={"max_memory": mem, "what_if": "max_batch", "context": 256})
    best_batch = r.json()["what_if"]["max_batch_size"]
    assert planner.api.fits(
        str(tiny_llama), max_memory=mem, batch_size=best_batch, context=256, prefill_chunk=PREFILL_CHUNK
    )
    assert not planner.api.fits(
        str(tiny_llama), max_memory=mem, batch_size=best_batch + 1, context=256, prefill_chunk=PREFILL_CHUNK
    )


def test_plan_that_cannot_fit_is_422_plan_error(client: httpx.Client) -> None:
    r = client.post("/plan", json={"max_memory": {"cpu": "10KiB"}})
    assert r.status_code == 422
    body = r.json()
    assert body["error_type"] == "plan" and "Traceback" not in body["error"]


def test_bad_planner_inputs_are_refused(client: httpx.Client) -> None:
    r = client.post("/plan", json={"max_memory": {"tpu": "1GiB"}})
    assert r.status_code == 422 and r.json()["error_type"] == "plan" and "tpu" in r.json()["error"]
    r = client.post("/plan", json={"batch_size": 0})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    r = client.post("/plan", json={"unknown_field": 1})
    assert r.status_code == 422 and "unknown_field" in r.json()["error"]


@pytest.mark.parametrize(
    "name,status",
    [
        ("../outside", 403),
        ("gpt2-copy/../../etc", 403),
        ("/etc", 403),
        ("llama", 403),  # a symlink to a directory outside the root
        ("escape", 403),  # ditto
        ("missing-model", 404),
    ],
)
def test_path_escapes_are_refused(client: httpx.Client, name: str, status: int) -> None:
    r = client.post("/plan", json={"model": name, "max_memory": {"cpu": "1GiB"}})
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == "validation"


def test_absolute_path_inside_a_root_is_allowed(client: httpx.Client, model_root: Path) -> None:
    r = client.post("/plan", json={"model": str(model_root / "gpt2-copy"), "max_memory": {"cpu": "1GiB"}})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def capped_server(tiny_llama: Path) -> Iterator[LiveServer]:
    """The tiny Llama (1024 positions) served with the default --max-total-tokens (2048), which they cap."""
    from service.settings import ServiceSettings

    s = LiveServer(ServiceSettings(model=str(tiny_llama), max_memory=["cpu=4GiB"]))
    s.start()
    yield s
    s.stop()


def test_plan_and_info_state_one_context_cap(capped_server: LiveServer, tiny_llama: Path) -> None:
    """The model's positions cap the default 2048: /info's limits, the plan in force, /plan's default workload (the
    served model's and another model's) all say 1024; a plan for a context beyond the positions is refused, naming
    both numbers."""
    positions = model_position_limit(tiny_llama)
    assert positions == 1024 < 2048
    with httpx.Client(base_url=capped_server.url, timeout=60) as c:
        info = c.get("/info").json()
        assert info["limits"]["max_total_tokens"] == positions
        assert info["limits"]["max_input_tokens"] < positions
        assert info["plan"]["workload"]["context"] == positions
        served = c.post("/plan", json={"max_memory": {"cpu": "1GiB"}})
        assert served.status_code == 200, served.text
        assert served.json()["workload"]["context"] == positions
        config = json.loads((tiny_llama / "config.json").read_text())
        other = c.post("/plan", json={"config": config, "max_memory": {"cpu": "1GiB"}})
        assert other.status_code == 200, other.text
        assert other.json()["workload"]["context"] == positions
        assert c.post("/plan", json={"context": 512}).json()["workload"]["context"] == 512
        refused = c.post("/plan", json={"context": 4096})
        assert refused.status_code == 422, refused.text
        message = refused.json()["error"]
        assert "4096" in message and "1024 positions" in message, message


def test_a_context_beyond_the_positions_is_refused_at_start(tiny_llama: Path) -> None:
    from service.model.background_load import resolve_model_dir
    from service.settings import ServiceSettings

    with pytest.raises(ValueError, match=r"--context 4096 is more than the 1024 positions"):
        resolve_model_dir(ServiceSettings(model=str(tiny_llama), context=4096))
