"""Shared helpers for the loader tests: a reference model per checkpoint, and equivalence checks."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

MAX_ABS_DIFF = 1e-5


@functools.cache
def reference_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """Plain transformers on the same weights: the ground truth every loaded model is compared with."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def prompt(vocab: int, length: int = 9, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def assert_equivalent(model: torch.nn.Module, path, dtype: str = "float32", new_tokens: int = 8) -> float:
    """Logits within MAX_ABS_DIFF of plain transformers' and identical greedy tokens. Returns the max diff."""
    ref = reference_model(str(path), dtype)
    ids = prompt(ref.config.vocab_size)
    with torch.no_grad():
        a = ref(ids).logits
        b = model(ids).logits
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= MAX_ABS_DIFF, f"logits differ from transformers' by {diff}"
    g_ref = ref.generate(ids[:1], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    g_new = model.generate(ids[:1], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert torch.equal(g_ref, g_new), f"greedy tokens differ: {g_ref.tolist()} vs {g_new.tolist()}"
    return diff


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private copy of a fixture checkpoint that a test may damage."""
    shutil.copytree(src, dst)
    return dst


def smaps_bytes(field: str, counted: Callable[[int, str], bool]) -> int:
    """Bytes of ``field`` (``Rss``, ``Anonymous``, ...) in ``/proc/self/smaps`` over the mappings for which
    ``counted(start address, the mapping's header line)`` holds."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = counted(int(head.split("-")[0], 16), line)
            elif inside and head == f"{field}:":
                total += int(line.split()[1]) * 1024
    return total


def mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (Linux ``/proc/self/maps``), None if anonymous memory."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5] if len(parts) > 5 and parts[5].startswith("/") else None
    return None


def edited_checkpoint(src: Path, dst: Path, change: Callable[[dict], None]) -> Path:
    """A copy of the single-file checkpoint ``src`` at ``dst`` whose state dict ``change`` edited in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    change(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
