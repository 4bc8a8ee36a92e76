"""``loadmaster env --calibrate``: measure the rates the cost model needs, on this machine, in under a minute.

- memory read bandwidth (a large tensor summed, best of a few);
- disk read rate, cold (pages dropped with ``posix_fadvise(DONTNEED)`` after an fsync) and warm, on a scratch
  file in the offload folder;
- the host -> GPU link, where there is a GPU (pinned copies);
- per dtype, the rate the decode-time linear path reaches (the native kernel where it loads, else torch), with
  weights resident and with weights read in place from a memory-mapped file (a warm ``disk`` block);
- the time a decode step spends per decoder layer and per step besides reading weights: two small Llamas (2 and
  8 layers) loaded by our loader and decoded with ``generate``; the slope is per layer, the rest per step.

The record (:class:`planner.calibration.Calibration`) is validated and saved atomically to the user's cache.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from planner.calibration import Calibration, KernelRate, machine_id

log = logging.getLogger(__name__)

Say = Callable[[str], None]


def _typical_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median time of ``fn`` after a warm-up. The median, not the best: decode is judged by its typical step
    (bench.common.time_generation takes the median gap), and on a shared machine the best run is the rare moment
    the neighbours were idle."""
    fn()  # warm-up: first touch, lazy builds
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_read(nbytes: int, repeats: int = 7) -> float:
    """Bytes/s of a streaming read of ``nbytes`` of RAM (torch's sum, over all of torch's threads)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return x.numel() * 4 / _typical_seconds(lambda: x.sum(), repeats)


def _read_all(path: Path, chunk: int = 8 << 20) -> int:
    total = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(view)
            if not n:
                return total
            total += n


def disk_read(folder: Path, nbytes: int) -> tuple[float, float, list[str]]:
    """(cold, warm) bytes/s reading a fresh scratch file of ``nbytes`` in ``folder``, and notes on the cold one."""
    notes: list[str] = []
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".loadmaster-calibrate-", dir=folder)
    path = Path(name)
    try:
        block = os.urandom(1 << 20)
        with os.fdopen(fd, "wb") as fh:
            for _ in range(nbytes >> 20):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        with open(path, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        size = _read_all(path)
        cold = size / (time.perf_counter() - t0)
        warm = size / min(_timed(lambda: _read_all(path)) for _ in range(3))
        if cold > 0.7 * warm:
            notes.append(
                "the cold read ran near the warm rate: this filesystem may not drop cached pages "
                "(overlay/tmpfs), so the cold figure is an upper bound"
            )
        return cold, warm, notes
    finally:
        path.unlink(missing_ok=True)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def link(nbytes: int, repeats: int = 5) -> float | None:
    """Host -> GPU 0 bytes/s from pinned memory; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / _typical_seconds(copy, repeats)


def _linear_fn(dtype: torch.dtype) -> tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The decode-time linear the loader uses for ``dtype``: the native operator where it runs, else torch's."""
    from loaders import cpu_kernels, kernel_ops  # noqa: F401  (kernel_ops registers torch.ops.loadmaster)

    if dtype in cpu_kernels.KERNELS and cpu_kernels.status(dtype).available:
        return "native", lambda x, w: torch.ops.loadmaster.linear(x, w, None)
    return "torch", lambda x, w: torch.nn.functional.linear(x, w)


def kernel_rate(dtype: torch.dtype, nbytes: int, folder: Path, repeats: int = 7) -> KernelRate:
    """Weight bytes/s of a one-row product (a decode step's linear), weights resident and memory-mapped."""
    elt = torch.tensor([], dtype=dtype).element_size()
    k = 4096
    n = max(nbytes // (k * elt), 64)
    path_name, fn = _linear_fn(dtype)
    with torch.inference_mode():
        x = torch.randn(1, k).to(dtype)
        w = torch.randn(n, k).to(dtype)
        resident = n * k * elt / _typical_seconds(lambda w=w: fn(x, w), repeats)
        fd, name = tempfile.mkstemp(prefix=".loadmaster-calibrate-", dir=folder)
        os.close(fd)
        try:
            w.view(torch.uint8).numpy().tofile(name)
            del w
            mapped_w = torch.from_file(name, shared=True, size=n * k, dtype=dtype).view(n, k)  # reads in place
            mapped = n * k * elt / _typical_seconds(lambda mapped_w=mapped_w: fn(x, mapped_w), repeats)
            del mapped_w
        finally:
            Path(name).unlink(missing_ok=True)
    return KernelRate(dtype=str(dtype).removeprefix("torch."), path=path_name, resident=resident, mapped=mapped)


def _small_llama(folder: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    out = folder / f"llama-{layers}"
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _decode_step_seconds(path: Path, new_tokens: int = 24, repeats: int = 3) -> float:
    """Median seconds between generated tokens (all runs pooled) of a model loaded by our loader, as ``serve`` and
    the benches load it."""
    from transformers import StoppingCriteria

    from loaders import load_model

    model = load_model(path, device_map={"": "cpu"}, dtype=torch.float32, show_progress=False)

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    gaps: list[float] = []
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.inference_mode():
        for _ in range(repeats):
            clock = Clock()
            model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                stopping_criteria=[clock],
                pad_token_id=0,
            )
            gaps += [b - a for a, b in zip(clock.times, clock.times[1:])]
    return statistics.median(gaps)


def step_overheads(folder: Path) -> tuple[float, float]:
    """(seconds per decoder layer, seconds per step) a decode step costs besides reading weights."""
    with tempfile.TemporaryDirectory(prefix="loadmaster-calibrate-", dir=folder) as tmp:
        few, many = 2, 8
        t_few = _decode_step_seconds(_small_llama(Path(tmp), few))
        t_many = _decode_step_seconds(_small_llama(Path(tmp), many))
    per_layer = max((t_many - t_few) / (many - few), 0.0)
    return per_layer, max(t_few - few * per_layer, 0.0)


def calibrate(
    folder: Path,
    size: int = 256 << 20,
    say: Say = log.info,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> Calibration:
    """Measure everything; ``size`` bytes per buffer (big enough to leave the CPU caches, small enough to be quick)."""
    started = time.perf_counter()
    notes: list[str] = []
    say("memory read bandwidth ...")
    mem = memory_read(size)
    say(f"  {mem / 1e9:.1f} GB/s")
    say(f"disk read at {folder} ...")
    cold, warm, disk_notes = disk_read(folder, size)
    notes += disk_notes
    say(f"  cold {cold / 1e9:.2f} GB/s, warm {warm / 1e9:.2f} GB/s")
    host_link = link(size)
    if host_link is not None:
        say(f"host -> GPU link {host_link / 1e9:.1f} GB/s")
    kernels: dict[str, KernelRate] = {}
    for dtype in dtypes:
        say(f"decode linear path, {str(dtype).removeprefix('torch.')} ...")
        kr = kernel_rate(dtype, size, folder)
        kernels[kr.dtype] = kr
        say(f"  {kr.path}: resident {kr.resident / 1e9:.1f} GB/s, memory-mapped {kr.mapped / 1e9:.1f} GB/s")
    say("per-layer and per-step decode overhead (two small Llamas) ...")
    per_layer, per_step = step_overheads(folder)
    say(f"  {per_layer * 1e3:.3f} ms per layer, {per_step * 1e3:.3f} ms per step")
    notes.append(f"measured in {time.perf_counter() - started:.1f} s with {torch.get_num_threads()} torch threads")
    return Calibration(
        machine=machine_id(),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        threads=torch.get_num_threads(),
        memory_read=mem,
        disk_cold=cold,
        disk_warm=warm,
        kernels=kernels,
        layer_overhead=per_layer,
        step_overhead=per_step,
        link=host_link,
        notes=notes,
    )
