"""``torchrun ... -m service.cli.pipeline_command``: the pipeline as an operator starts it, two real ranks on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _torchrun(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "service.cli.pipeline_command", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_torchrun_two_ranks_generate_what_transformers_generates(tiny_gpt2):
    prompts = ["hello world", "the cat sat"]
    flags = [f"--prompt={p}" for p in prompts]
    r = _torchrun(str(tiny_gpt2), *flags, "--max-new-tokens", "5", "--max-memory", "cpu=1GiB")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    for line, prompt in zip(lines, prompts, strict=True):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False
        )
        assert line["token_ids"] == ref[0, ids.shape[1] :].tolist()


def test_started_without_torchrun_exits_2():
    r = subprocess.run(
        [sys.executable, "-m", "service.cli.pipeline_command", "x", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
    )
    assert r.returncode == 2 and "start it with torchrun" in r.stderr
