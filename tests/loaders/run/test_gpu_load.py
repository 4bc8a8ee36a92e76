"""Loading straight to GPUs, on stand-in GPUs with CUDA's ordering rules (tests/loaders/gpu_standins.py).

Each test loads a real checkpoint through :class:`loaders.checkpoint.materialize.Materializer` and compares every tensor
byte for byte with safetensors' own reading of the shards, after the stand-in GPUs have run every queued copy.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from loaders.checkpoint.index import CheckpointIndex
from loaders.checkpoint.layout import to_torch_index
from loaders.checkpoint.load_progress import ProgressReporter
from loaders.checkpoint.materialize import Materializer
from planner.model.checkpoint_keys import Piece, TensorSource
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


def test_a_cast_never_allocates_a_full_temporary_on_the_gpu(tiny_llama):
    """Issue 14 item 9: an fp32 tensor loaded as bf16 was uploaded whole into a GPU temporary in fp32, then cast.
    Now every GPU allocation in the stored dtype is at most one staging chunk, and the values are the cast ones."""
    out, gpus = _load(tiny_llama, lambda i: i % 2, run_dtype=torch.bfloat16)
    gpus.flush_all()
    ref = _checkpoint(tiny_llama)
    dests = {(gpus.device_of(t), tuple(t.shape), t.dtype) for t in out.values()}
    scratch = [a for a in gpus.allocations if a not in dests]
    biggest = max(math.prod(shape) * dtype.itemsize for _, shape, dtype in scratch)
    assert biggest <= CHUNK, f"a {biggest}-byte temporary on the GPU for a cast (chunk {CHUNK})"
    wrong = [k for k, t in ref.items() if not torch.equal(out[k], t.to(torch.bfloat16))]
    assert not wrong and all(t.dtype == torch.bfloat16 for t in out.values()), wrong[:3]


def test_fused_expert_slices_load_through_the_scratch_buffer(tiny_moe):
    """Mixtral's per-expert keys land in slices of fused tensors (strided, not contiguous): byte-exact on GPU 1."""
    from loaders.checkpoint.layout import resolve_sources
    from planner.model.skeleton import describe_checkpoint

    described = describe_checkpoint(tiny_moe)
    wanted = {t.name: t.shape for t in described.skeleton.tensors() if t.kind != "buffer_nonpersistent"}
    index = CheckpointIndex.open(tiny_moe)
    sources = resolve_sources(wanted, index, ignore_unexpected=[r"rotary_emb\.inv_freq$"])
    gpus = StandInGpus()
    reporter = ProgressReporter(sum(e.nbytes for e in index.entries.values()), None, show_bar=False)
    mat = Materializer(
        index, torch.float32, [], reporter, model_path=tiny_moe, has_gpu=True, copies=gpus, staging_chunk=CHUNK
    )
    out = mat.materialize(sources, dict.fromkeys(sources, 1))
    gpus.flush_all()
    ckpt = _checkpoint(tiny_moe)
    fused = [n for n, src in sources.items() if not src.is_plain]
    assert fused, "the MoE checkpoint should need fused tensors"
    for name in fused:
        for piece in sources[name].pieces:
            part = out[name][to_torch_index(piece.index)] if piece.index else out[name]
            assert torch.equal(part, ckpt[piece.key].view(part.shape)), f"{name} <- {piece.key}"


def test_each_gpu_is_filled_by_its_own_thread(tiny_llama):
    """Issue 14 item 9: one thread read for every GPU in turn. Each GPU now has its own reader thread."""
    _, gpus = _load(tiny_llama, lambda i: i % 2)
    assert set(gpus.copy_threads) == {0, 1}
    assert gpus.copy_threads[0].isdisjoint(gpus.copy_threads[1]), "one thread issued the copies for both GPUs"


def test_bf16_is_refused_on_gpus_older_than_ampere_with_the_fix():
    """Issue 14 item 12: no check for bf16 on pre-Ampere GPUs. The check gets each GPU's compute capability."""
    from loaders.checkpoint.placement import check_bf16_support
    from planner.errors import PlanError

    caps = {0: (8, 0), 1: (7, 5)}
    names = {0: "NVIDIA A100", 1: "Tesla T4"}
    with pytest.raises(PlanError, match=r"GPU 1 \(Tesla T4, compute capability 7\.5\).*--dtype float16"):
        check_bf16_support([0, 1], torch.bfloat16, caps.__getitem__, names.__getitem__)
    check_bf16_support([0], torch.bfloat16, caps.__getitem__, names.__getitem__)  # Ampere: fine
    check_bf16_support([0, 1], torch.float16, caps.__getitem__, names.__getitem__)  # fp16 is native on both
