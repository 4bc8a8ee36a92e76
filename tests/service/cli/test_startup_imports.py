"""What the server leaves unimported at start (:mod:`service.cli.startup_imports`), in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_PROBE = """
import sys
from service.cli.startup_imports import skip_triton_without_cuda
print(skip_triton_without_cuda())
try:
    import triton  # noqa: F401
    print("importable")
except ImportError:
    print("absent")
from transformers.models.llama import modeling_llama  # transformers' model code still imports without it
print("triton" in sys.modules and sys.modules["triton"] is not None)
"""


def _probe(**env: str) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device Triton stays importable by design")
def test_without_cuda_triton_is_left_unimported_and_transformers_still_loads() -> None:
    assert _probe() == ["True", "absent", "False"]


def test_keep_triton_leaves_the_import_alone() -> None:
    done, _, loaded = _probe(LOADMASTER_KEEP_TRITON="1")
    assert done == "False"
    assert loaded in ("True", "False")  # whether Triton is installed at all is this machine's business


def test_the_app_imports_no_attention_code_before_it_listens() -> None:
    """Making the app (what the server does before it listens) leaves the loader's attention module, and the
    transformers model code it pulls in, to the loading thread."""
    probe = (
        "import sys, service.http.app\n"
        "print(any(m in sys.modules for m in ('loaders.native.attention', 'transformers.integrations.sdpa_attention')))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False"]
