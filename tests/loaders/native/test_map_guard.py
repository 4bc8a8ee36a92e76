"""The disk tier's shard maps are guarded (issue 38): a shard truncated under a model that reads it in place makes
the next step read zeros and count a fault, which :func:`loaders.native.map_guard.check` reports as an error; the
process is not killed by SIGBUS (it would take this test run with it). A fault outside the guarded maps is left to
the handler installed before."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import loaders
from loaders.errors import WeightsChangedError
from loaders.native import map_guard
from tests.loaders.helpers import copy_checkpoint, prompt

pytestmark = pytest.mark.skipif(not map_guard.available(), reason="no C compiler to build the SIGBUS guard")


def test_a_truncated_disk_shard_is_an_error_not_a_signal(tiny_llama, tmp_path):
    model_dir = copy_checkpoint(tiny_llama, tmp_path / "model")
    model = loaders.load_model(
        model_dir, device_map={"": "disk"}, offload_folder=tmp_path / "off", show_progress=False, dtype="float32"
    )
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        model(ids)
    map_guard.check(model)  # nothing truncated yet
    assert map_guard.faults(model) == 0
    for shard in model_dir.glob("*.safetensors"):
        os.truncate(shard, 0)
    with torch.no_grad():
        logits = model(ids).logits  # read past the files' ends: zeros, and this process lives on
    assert torch.isfinite(logits).all()
    assert map_guard.faults(model) > 0
    lost = map_guard.truncated_files(model)
    assert lost and all(Path(p).parent == model_dir.resolve() for p in lost)
    with pytest.raises(WeightsChangedError, match=f"{Path(lost[0]).name}.*truncated while the server ran"):
        map_guard.check(model)
    other = loaders.load_model(tiny_llama, device_map={"": "cpu"}, show_progress=False, dtype="float32")
    map_guard.check(other)  # another model's step is not failed by this one's faults


def test_a_fault_outside_the_guarded_maps_still_kills(tmp_path):
    """The guard leaves other mappings alone: an unguarded map read past its file's end dies of SIGBUS as before."""
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (4 * mmap.PAGESIZE))
    script = textwrap.dedent(
        f"""
        import mmap, os
        from loaders.native import map_guard
        guarded = mmap.mmap(os.open({str(path)!r}, os.O_RDONLY), 0, access=mmap.ACCESS_COPY)
        assert map_guard.guard(guarded)
        loose = mmap.mmap(os.open({str(path)!r}, os.O_RDONLY), 0, access=mmap.ACCESS_COPY)
        os.truncate({str(path)!r}, 0)
        assert guarded[3 * mmap.PAGESIZE] == 0  # zeros, counted
        print("guarded read survived", flush=True)
        loose[3 * mmap.PAGESIZE]
        print("unreachable", flush=True)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert "guarded read survived" in proc.stdout, proc.stderr[-2000:]
    assert "unreachable" not in proc.stdout
    assert proc.returncode == -7  # SIGBUS
