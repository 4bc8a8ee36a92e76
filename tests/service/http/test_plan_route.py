"""POST /plan: dry runs for the served model, model roots and inline configs; what-ifs; path escapes refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import planner
from planner.types import PREFILL_CHUNK, Plan


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
