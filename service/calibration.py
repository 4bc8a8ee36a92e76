"""``loadmaster env --calibrate``: measure the rates the cost model needs, on this machine, in under a minute.

- memory read bandwidth (a large tensor summed, best of a few);
- disk read rate, cold (pages dropped with ``posix_fadvise(DONTNEED)`` after an fsync) and warm, on a scratch
  file in the offload folder;
- the host -> GPU link, where there is a GPU (pinned copies);
- per dtype, the decode-time linear path (the native kernel where it loads, else torch): one-row products over a
  sweep of matrix sizes (256 KiB to 32 MiB of weights), each size cut from a pool larger than the CPU's caches and
  read once per pass, as a decode step reads its weights; ``seconds = fixed cost per call + bytes / rate`` fitted
  over the sizes, with the weights resident and read in place from a memory-mapped file (a warm ``disk`` block);
- the time a decode step spends besides reading weights: small, narrow Llamas (2 and 10 layers) loaded by our loader
  (native linears, alignment and readahead hooks as served) and decoded with ``generate``; the slope is per layer,
  the rest per step; the 10-layer one again with every layer on ``disk`` gives what a disk layer adds.

Everything runs on torch's threads as set when it is called: the figures describe that thread count (recorded), and
on a shared machine the neighbours' load of that moment.

The record (:class:`planner.calibration.Calibration`) is validated and saved atomically to the user's cache.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from planner.calibration import Calibration, CallFit, KernelRate, fit_calls, machine_id

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


#: Runs of a measurement whose best is kept, as the decode benches keep the best of their runs.
RUNS = 3


def _best_typical_seconds(fn: Callable[[], object], per_run: int = 3, runs: int = RUNS) -> float:
    """The best of ``runs`` runs' median times (each of ``per_run`` calls): the estimator the decode measurements use
    (bench.common.best_of keeps the best of fresh-process runs, each run's rate is its median step), so that on a
    shared machine a calibration and a decode measured under the same load agree."""
    fn()  # warm-up: first touch, lazy builds
    medians = []
    for _ in range(runs):
        times = []
        for _ in range(per_run):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return min(medians)


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


#: Weight bytes of the matrices the kernel sweep times: from a 100M model's smallest projection to a 1B model's MLP.
SWEEP_BYTES = (1 << 18, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
#: The inner (input) dimension of the swept matrices: a decoder's hidden size.
SWEEP_WIDTH = 2048


def _sweep(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], pool: torch.Tensor, repeats: int) -> CallFit:
    """Per matrix size, the typical time of a pass that multiplies one row by every matrix cut from ``pool`` in turn
    (each read once, as a decode step reads each weight once; the pool is larger than the CPU's caches), divided by
    the number of matrices; then the fit over sizes."""
    elt = pool.element_size()
    rows_total = pool.shape[0]
    x = torch.randn(1, SWEEP_WIDTH).to(pool.dtype)
    points = []
    for nbytes in SWEEP_BYTES:
        rows = max(nbytes // (SWEEP_WIDTH * elt), 1)
        mats = [pool[i : i + rows] for i in range(0, rows_total - rows + 1, rows)]

        def one_pass(mats: list[torch.Tensor] = mats) -> None:
            for w in mats:
                fn(x, w)

        points.append((rows * SWEEP_WIDTH * elt, _best_typical_seconds(one_pass, repeats) / len(mats)))
    return fit_calls(points)


def kernel_rate(dtype: torch.dtype, nbytes: int, folder: Path, repeats: int = 3) -> KernelRate:
    """One-row products (a decode step's linears) over a sweep of matrix sizes, weights resident and memory-mapped:
    the fitted bytes/s and fixed seconds per call."""
    elt = torch.tensor([], dtype=dtype).element_size()
    rows = max(nbytes // (SWEEP_WIDTH * elt), 64)
    path_name, fn = _linear_fn(dtype)
    with torch.inference_mode():
        pool = torch.randn(rows, SWEEP_WIDTH).to(dtype)
        resident = _sweep(fn, pool, repeats)
        fd, name = tempfile.mkstemp(prefix=".loadmaster-calibrate-", dir=folder)
        os.close(fd)
        try:
            pool.view(torch.uint8).numpy().tofile(name)
            del pool
            # read in place, as a disk block's weights are (views of the shard's mapping); the pages are cached
            mapped_pool = torch.from_file(name, shared=True, size=rows * SWEEP_WIDTH, dtype=dtype)
            mapped = _sweep(fn, mapped_pool.view(rows, SWEEP_WIDTH), repeats)
            del mapped_pool
        finally:
            Path(name).unlink(missing_ok=True)
    return KernelRate(
        dtype=str(dtype).removeprefix("torch."),
        path=path_name,
        resident=resident.rate,
        mapped=mapped.rate,
        call_overhead=resident.overhead,
    )


def _small_llama(folder: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    out = folder / f"llama-{layers}"
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _layers_map(layers: int, where: str) -> dict[str, str]:
    """Every decoder layer on ``where`` (``cpu`` or ``disk``), the rest of the model on the CPU."""
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": where for i in range(layers)})
    return dm


def _decode_step_seconds(path: Path, device_map: dict[str, str], new_tokens: int = 24, repeats: int = RUNS) -> float:
    """Seconds between generated tokens of a model loaded by our loader, as ``serve`` and the benches load it
    (native linears; on ``disk`` layers the memory maps and readahead hooks): the best of ``repeats`` generations'
    median gaps, the estimator of the decode benches."""
    from transformers import StoppingCriteria

    from loaders import load_model

    model = load_model(
        path, device_map=device_map, dtype=torch.float32, offload_folder=path / "offload", show_progress=False
    )

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    medians: list[float] = []
    ids = torch.arange(1, 17).unsqueeze(0)
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
            medians.append(statistics.median(b - a for a, b in zip(clock.times, clock.times[1:])))
    return min(medians)


@dataclass(frozen=True)
class StepOverheads:
    """Seconds a decode step costs besides reading weights: per decoder layer, extra per disk layer, per step."""

    per_layer: float
    per_disk_layer: float
    per_step: float


def step_overheads(folder: Path) -> StepOverheads:
    """Decode a small Llama (narrow layers, so reading their weights costs next to nothing) with 2 and with 10
    layers: the slope is the cost of a layer, the rest the cost of a step; the 10-layer model once more with every
    layer on ``disk`` gives what a disk layer adds (its readahead hook and mapped pages)."""
    few, many = 2, 10
    with tempfile.TemporaryDirectory(prefix="loadmaster-calibrate-", dir=folder) as tmp:
        small, big = _small_llama(Path(tmp), few), _small_llama(Path(tmp), many)
        t_few = _decode_step_seconds(small, _layers_map(few, "cpu"))
        t_many = _decode_step_seconds(big, _layers_map(many, "cpu"))
        t_disk = _decode_step_seconds(big, _layers_map(many, "disk"))
    per_layer = max((t_many - t_few) / (many - few), 0.0)
    return StepOverheads(
        per_layer=per_layer,
        per_disk_layer=max((t_disk - t_many) / many, 0.0),
        per_step=max(t_few - few * per_layer, 0.0),
    )


def calibrate(
    folder: Path,
    size: int = 128 << 20,
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
        say(
            f"  {kr.path}: resident {kr.resident / 1e9:.1f} GB/s, memory-mapped {kr.mapped / 1e9:.1f} GB/s, "
            f"{kr.call_overhead * 1e6:.0f} us per call"
        )
    say("per-layer and per-step decode overhead (small Llamas, resident and on disk) ...")
    over = step_overheads(folder)
    say(
        f"  {over.per_layer * 1e3:.3f} ms per layer (+{over.per_disk_layer * 1e3:.3f} on disk), "
        f"{over.per_step * 1e3:.3f} ms per step"
    )
    notes.append(f"measured in {time.perf_counter() - started:.1f} s with {torch.get_num_threads()} torch threads")
    return Calibration(
        machine=machine_id(),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        threads=torch.get_num_threads(),
        memory_read=mem,
        disk_cold=cold,
        disk_warm=warm,
        kernels=kernels,
        layer_overhead=over.per_layer,
        step_overhead=over.per_step,
        disk_layer_overhead=over.per_disk_layer,
        link=host_link,
        notes=notes,
    )
