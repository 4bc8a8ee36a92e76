"""Loading straight to GPUs, on stand-in GPUs with CUDA's ordering rules (tests/loaders/gpu_standins.py).

Each test loads a real checkpoint through :class:`loaders.materialize.Materializer` and compares every tensor
byte for byte with safetensors' own reading of the shards, after the stand-in GPUs have run every queued copy.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from loaders.materialize import Materializer
from loaders.progress import ProgressReporter
from loaders.safetensors_index import CheckpointIndex
from planner.checkpoint_keys import Piece, TensorSource
from tests.loaders.gpu_standins import StandInGpus

CHUNK = 4096  # bytes: every tensor of the tiny models spans several staging chunks


def _checkpoint(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _load(path, devices_of, run_dtype=torch.float32, **kwargs):
    index = CheckpointIndex.open(path)
    sources = {k: TensorSource(k, tuple(e.shape), (Piece(k),)) for k, e in index.entries.items()}
    gpus = StandInGpus()
    reporter = ProgressReporter(sum(e.nbytes for e in index.entries.values()), None, show_bar=False)
    mat = Materializer(
        index, run_dtype, [], reporter, model_path=path, has_gpu=True, copies=gpus, staging_chunk=CHUNK, **kwargs
    )
    out = mat.materialize(sources, {k: devices_of(i) for i, k in enumerate(sources)})
    return out, gpus


@pytest.mark.parametrize("devices_of", [lambda i: 1, lambda i: i % 2], ids=["all-on-gpu1", "alternating-gpu0-gpu1"])
def test_weights_loaded_onto_any_gpu_equal_the_checkpoint(tiny_llama, devices_of):
    """Issue 14 item 1: the staging loop waited for events recorded on GPU 0's stream while the copy to GPU 1 ran
    on GPU 1's, so a pinned buffer was refilled before its copy ran and GPU 1 received the wrong bytes."""
    out, gpus = _load(tiny_llama, devices_of)
    gpus.flush_all()
    ref = _checkpoint(tiny_llama)
    assert max(t.numel() * t.element_size() for t in ref.values()) > 2 * CHUNK
    assert {gpus.device_of(t) for t in out.values()} == {devices_of(i) for i in range(len(out))}
    wrong = [k for k, t in ref.items() if not torch.equal(out[k], t)]
    assert not wrong, f"{len(wrong)} of {len(ref)} tensors differ from the checkpoint, e.g. {wrong[:3]}"


def test_every_copy_has_finished_when_the_load_returns(tiny_llama):
    """The final synchronize waits on each GPU's own stream: nothing is left queued once materialize returns."""
    out, gpus = _load(tiny_llama, lambda i: i % 2)
    assert gpus.pending() == 0
    ref = _checkpoint(tiny_llama)
    assert all(torch.equal(out[k], t) for k, t in ref.items())
