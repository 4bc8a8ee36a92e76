"""Fixtures for models by Hub id: a fake Hub on a free port, the repositories it serves, and the CLI run against it.

The CLI runs as a subprocess: huggingface_hub reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` when it is
imported, and the test session itself runs with ``HF_HUB_OFFLINE=1`` (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import user_caches
from tests.hub.fake_hub import FakeHub
from tests.sparse_checkpoint import write_sparse_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = "org/tiny-llama"
BIG = "org/llama-100m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def dead_endpoint() -> str:
    """A URL on which nothing listens (the port was free a moment ago): what an unreachable Hub looks like."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def hub_env(endpoint: str, hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOADMASTER_"))}
    env.update(user_caches.env())  # the run's own caches (tests/user_caches.py), never the user's
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(ROOT),
    )
    if "LOADMASTER_TEST_CACHE" in os.environ:
        env["LOADMASTER_TEST_CACHE"] = os.environ["LOADMASTER_TEST_CACHE"]
    env.update(extra)
    return env


def loadmaster(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def repo_files(folder: Path, skip: tuple[str, ...] = ("loadmaster_build.json",)) -> dict[str, Path]:
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip}


@pytest.fixture(scope="session")
def big_llama(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """A ~210 MB bf16 Llama (the benchmarks' 100M shape) in 4 shards, written sparse: real safetensors whose data
    is zeros and costs no disk, with a real config and the tiny models' tokenizer (same vocabulary)."""
    from transformers import LlamaConfig

    from planner.model.skeleton import build_meta_model
    from service.model.random_models import MODEL_SPECS

    tiny_cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg = LlamaConfig(
        vocab_size=tiny_cfg["vocab_size"],
        tie_word_embeddings=False,
        dtype="bfloat16",
        bos_token_id=tiny_cfg.get("bos_token_id"),
        eos_token_id=tiny_cfg.get("eos_token_id"),
        pad_token_id=tiny_cfg.get("pad_token_id"),
        **MODEL_SPECS[("llama", "100m")],
    )
    out = tmp_path_factory.mktemp("llama-100m")
    cfg.save_pretrained(out)
    model = build_meta_model(cfg)
    tensors = {
        n: ("bfloat16", tuple(t.shape)) for n, t in model.state_dict().items() if not n.endswith("rotary_emb.inv_freq")
    }
    write_sparse_checkpoint(out, tensors, shards=4)
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (tiny_llama / name).is_file():
            shutil.copy(tiny_llama / name, out / name)
    return out


@pytest.fixture(scope="session")
def pickles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Files a repository may hold that loadmaster must never fetch (their content is irrelevant: never read)."""
    d = tmp_path_factory.mktemp("other-files")
    out = {}
    for name, size in (("pytorch_model.bin", 300_000), ("training_args.bin", 1000), ("README.md", 200)):
        (d / name).write_bytes(b"\0" * size)
        out[name] = d / name
    return out


@pytest.fixture(scope="session")
def fake_hub(
    tiny_llama: Path, big_llama: Path, pickles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FakeHub]:
    hub = FakeHub()
    hub.add_repo(TINY, {**repo_files(tiny_llama), **pickles})
    hub.add_repo(BIG, repo_files(big_llama))
    hub.add_repo("org/gated", repo_files(tiny_llama), gated=True, tokens=("hf_granted",))
    hub.add_repo(
        "org/pickled-only",
        {
            "config.json": tiny_llama / "config.json",
            "pytorch_model.bin": pickles["pytorch_model.bin"],
            "training_args.bin": pickles["training_args.bin"],
        },
    )
    # a model bigger than the free disk (sparse: it costs nothing here)
    huge = tmp_path_factory.mktemp("huge")
    free = shutil.disk_usage(huge).free
    elements = (free + (64 << 30)) // 4
    write_sparse_checkpoint(huge, {"model.embed_tokens.weight": ("float32", (elements // 1024, 1024))})
    shutil.copy(tiny_llama / "config.json", huge / "config.json")
    hub.add_repo("org/huge", repo_files(huge))
    hub.start()
    yield hub
    hub.stop()
