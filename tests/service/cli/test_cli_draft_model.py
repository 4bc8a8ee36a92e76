"""``loadmaster serve --draft-model DIR`` (issue 35): a server drafting with a smaller checkpoint shows it in /info
with what its plan reserved for it; every bad case is refused by name, with exit 2: a missing or non-safetensors
draft, one combined with --speculate or --pipeline (flag checks, before anything loads), and one whose tokenizer
differs from the target's (found at load, before any weight is read)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from service.settings import ServiceSettings
from tests.service.cli.test_cli_serve import REPO, _env


def _serve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", *args, "--port", "0"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "flags,mentions",
    [
        (["--draft-model", "/no/such/draft"], "--draft-model '/no/such/draft' is not a directory"),
        (["--draft-model", "{pickled}"], "is not a safetensors checkpoint"),
        (["--draft-model", "{draft}", "--speculate", "ngram"], "--speculate ngram drafts another way"),
        (["--draft-model", "{draft}", "--speculate", "int4"], "--speculate int4 drafts another way"),
        (["--draft-model", "{draft}", "--pipeline"], "--draft-model does not apply to a --pipeline"),
    ],
)
def test_bad_drafts_exit_2_with_one_line(
    tiny_llama: Path, tiny_draft_llama: Path, tmp_path: Path, flags: list[str], mentions: str
) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_draft_llama / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\0" * 16)
    argv = [f.replace("{pickled}", str(pickled)).replace("{draft}", str(tiny_draft_llama)) for f in flags]
    p = _serve(str(tiny_llama), *argv)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("loadmaster: error:") and mentions in lines[-1], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "extra,mentions",
    [({"speculate": "ngram"}, "drafts another way"), ({"pipeline": True}, "does not apply to a --pipeline")],
)
def test_the_settings_refuse_a_draft_model_beside_another_draft_kind(
    tiny_llama: Path, tiny_draft_llama: Path, extra: dict[str, Any], mentions: str
) -> None:
    with pytest.raises(ValidationError, match=mentions):
        ServiceSettings(model=str(tiny_llama), draft_model=str(tiny_draft_llama), **extra)
    settings = ServiceSettings(model=str(tiny_llama), draft_model=str(tiny_draft_llama))
    assert settings.speculation_mode == "model" and settings.speculate == "off"


def test_a_draft_with_another_tokenizer_stops_the_server_with_exit_2(
    tiny_llama: Path, tiny_draft_llama: Path, tmp_path: Path
) -> None:
    from loaders import load_tokenizer

    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_draft_llama, other)
    tokenizer = load_tokenizer(other)
    tokenizer.add_tokens(["<only-in-the-draft>"])
    tokenizer.save_pretrained(other)
    p = _serve(str(tiny_llama), "--draft-model", str(other), "--max-memory", "cpu=4GiB")
    assert p.returncode == 2, p.stderr
    assert "--draft-model other-vocab has another vocabulary than" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_a_server_drafting_with_a_draft_model_reports_it_and_its_cost(tiny_llama: Path, tiny_draft_llama: Path):
    from service.schemas.response_models import InfoResponse
    from tests.service.conftest import LiveServer, settings_for

    server = LiveServer(settings_for(tiny_llama, draft_model=str(tiny_draft_llama), speculate_tokens=3)).start()
    try:
        body = {"inputs": "one two three one two three", "parameters": {"max_new_tokens": 24}}
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        info = httpx.get(server.url + "/info", timeout=30).json()
    finally:
        server.stop()
    InfoResponse.model_validate(info)  # the documented shape
    spec = info["speculation"]
    assert spec["mode"] == "model" and spec["draft_tokens"] == 3
    draft = spec["draft_model"]
    assert draft["scheme"] == "model" and draft["name"] == tiny_draft_llama.name and draft["bytes"] > 0
    cpu = next(b for b in info["plan"]["budgets"] if b["device"] == "cpu")
    assert draft["reserved_bytes"] == cpu["draft"] > draft["bytes"]  # its weights, and its working memory and KV
    assert draft["cost"].startswith(f"draft: draft model {tiny_draft_llama.name}")
    assert draft["cost"] in info["plan"]["reasons"]
    assert info["plan"]["workload"]["draft"]["label"] == f"draft model {tiny_draft_llama.name}"
    assert info["memory"]["cpu"]["planned"]["draft"] == cpu["draft"]
    assert spec["proposed"] > 0 and spec["verify_passes"] > 0
