"""Every file read for ``serve`` or ``/plan`` resolves, symlinks followed, under the configured roots.

``serve``: the model's own directory unless ``--allowed-root`` says otherwise; ``/plan``: ``--model-root`` plus
``--allowed-root``. A link that leads out, or a path that climbs out with ``..``, is refused naming the path and
the option that would allow it; files inside the roots, links included, work.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest

from service.cli.main import main
from service.model.background_load import resolve_model_dir
from service.model.model_paths import PathEscapeError
from tests.service.conftest import LiveServer, settings_for

LINKED = "tokenizer.json"


def _split_model(tiny_llama: Path, tmp: Path) -> tuple[Path, Path]:
    """``models/m``: the tiny Llama, whose tokenizer file is a link into ``store/`` (a directory beside ``models``).
    The tokenizer is the file to move: shards named by an index were already confined by the loader; the
    tokenizer, config and the rest were read wherever their links led."""
    models, store = tmp / "models", tmp / "store"
    (models / "m").mkdir(parents=True)
    store.mkdir()
    for f in tiny_llama.iterdir():
        if f.is_file():
            shutil.copy(f, models / "m" / f.name)
    linked = models / "m" / LINKED
    linked.rename(store / LINKED)
    linked.symlink_to(store / LINKED)
    return models, store


def test_a_file_linking_out_of_the_model_directory_is_refused_at_start(tiny_llama: Path, tmp_path: Path) -> None:
    models, _ = _split_model(tiny_llama, tmp_path)
    with pytest.raises(PathEscapeError) as info:
        resolve_model_dir(settings_for(models / "m"))
    message = str(info.value)
    assert str(models / "m" / LINKED) in message and "--allowed-root" in message


def test_serve_exits_2_with_one_line_naming_the_link_and_the_option(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models, _ = _split_model(tiny_llama, tmp_path)
    assert main(["serve", str(models / "m"), "--port", "1", "--max-memory", "cpu=4GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loadmaster: error:"), err
    assert LINKED in err[0] and "--allowed-root" in err[0]


def test_allowed_roots_admit_the_directory_a_link_points_into(tiny_llama: Path, tmp_path: Path) -> None:
    models, store = _split_model(tiny_llama, tmp_path)
    settings = settings_for(models / "m", allowed_root=[str(models), str(store)])
    assert resolve_model_dir(settings) == (models / "m").resolve()
    # without the store among the roots, the same link is refused
    with pytest.raises(PathEscapeError, match="outside the allowed roots"):
        resolve_model_dir(settings_for(models / "m", allowed_root=[str(models)]))


def test_dot_dot_out_of_the_allowed_roots_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    models, store = _split_model(tiny_llama, tmp_path)
    (models / "sub").mkdir()
    (store / "m2").mkdir()
    for f in (models / "m").iterdir():
        shutil.copy(f, store / "m2" / f.name)  # a complete model, but outside the root
    climbing = models / "sub" / ".." / ".." / "store" / "m2"
    with pytest.raises(PathEscapeError) as info:
        resolve_model_dir(settings_for(climbing, allowed_root=[str(models)]))
    assert "resolves to" in str(info.value) and "--allowed-root" in str(info.value)


def _wait_phase(url: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(url + "/health/ready", timeout=10).json()
        if body.get("status") in ("ready", "failed"):
            return body
        time.sleep(0.1)
    raise AssertionError("the server neither loaded nor failed in time")


def test_a_real_server_refuses_the_link_and_serves_once_its_root_is_allowed(tiny_llama: Path, tmp_path: Path) -> None:
    models, store = _split_model(tiny_llama, tmp_path)
    refused = LiveServer(settings_for(models / "m")).start(wait_ready=False)
    try:
        state = _wait_phase(refused.url)
        assert state["status"] == "failed", state
        assert LINKED in str(state) and "--allowed-root" in str(state)
    finally:
        refused.stop()
    allowed = LiveServer(settings_for(models / "m", allowed_root=[str(models), str(store)])).start()
    try:
        r = httpx.post(
            allowed.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}, timeout=60
        )
        assert r.status_code == 200, r.text
    finally:
        allowed.stop()


def test_plan_refuses_a_model_file_linking_out_of_the_model_roots(
    client: httpx.Client, model_root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.json"
    outside.write_text((model_root / "gpt2-copy" / "config.json").read_text())
    leaky = model_root / f"leaky-{uuid.uuid4().hex[:8]}"
    leaky.mkdir()
    for f in (model_root / "gpt2-copy").iterdir():
        shutil.copy(f, leaky / f.name)
    (leaky / "config.json").unlink()
    (leaky / "config.json").symlink_to(model_root / "gpt2-copy" / "config.json")  # stays inside the root: allowed
    ok = client.post("/plan", json={"model": leaky.name})
    assert ok.status_code == 200, ok.text
    (leaky / "config.json").unlink()
    (leaky / "config.json").symlink_to(outside)
    r = client.post("/plan", json={"model": leaky.name})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert str(leaky.resolve() / "config.json") in error and "--model-root or --allowed-root" in error
